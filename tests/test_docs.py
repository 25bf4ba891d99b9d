"""The docs agree with the files and the code.

CONTRIBUTING.md's layout tree, at this granularity: every path the tree
names exists, and the tree names every file of ``python/lloyal`` (modules,
stubs, ``py.typed``), every file of the crates' ``src/``, ``tests/`` and
``examples/`` except a folder's ``mod.rs`` (it only declares and
re-exports; the folder's own line stands for it), and every file of
``scripts/`` and ``.github/workflows/``. Other top-level folders
(``tests/``, ``bench/``, ``examples/``, ``docs/``) are named as folders only.

The tree's format: a line is a path (or several, separated by ``", "``),
then two or more spaces and a description. A path indented two spaces
deeper than a folder line (one ending in ``/``) lies inside that folder;
a line indented further than that continues the description above it.

The README and docs/README.md: the README names every CLI command in its
CLI block and every exception of ``lloyal.errors`` in its Errors section,
and links every example folder; both link every page in ``docs/``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import lloyal
import lloyal.errors
import pytest
from lloyal.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def layout_paths() -> list[str]:
    """The paths CONTRIBUTING.md's layout tree names, relative to the root
    (folders end in ``/``)."""
    found = re.search(r"## Layout\n.*?```text\n(.*?)```", CONTRIBUTING.read_text(), flags=re.S)
    assert found, "CONTRIBUTING.md has no ```text block under ## Layout"
    paths: list[str] = []
    folders: list[tuple[int, str]] = []  # (indent, path) of the enclosing folders
    last = -2
    for line in found.group(1).splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent > last + 2:  # the description above, continued
            continue
        last = indent
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = folders[-1][1] if folders else ""
        field = re.split(r" {2,}", line.strip(), maxsplit=1)[0]
        for name in field.split(", "):
            assert re.fullmatch(r"[\w./-]+", name), f"not a path in the layout: {line.strip()!r}"
            path = base + name
            paths.append(path)
            if name.endswith("/"):
                folders.append((indent, path))
    return paths


def files_to_list() -> set[str]:
    """The files the layout tree must name (see the module docstring)."""
    out: set[str] = set()
    package = ROOT / "python" / "lloyal"
    for f in package.rglob("*"):
        if f.is_file() and (f.suffix in (".py", ".pyi") or f.name == "py.typed"):
            out.add(f.relative_to(ROOT).as_posix())
    for crate in (ROOT / "crates").iterdir():
        for part in ("src", "tests", "examples"):
            for f in (crate / part).rglob("*.rs"):
                if f.name != "mod.rs":
                    out.add(f.relative_to(ROOT).as_posix())
    for folder in ("scripts", ".github/workflows"):
        for f in (ROOT / folder).iterdir():
            if f.is_file():
                out.add(f.relative_to(ROOT).as_posix())
    return out


def test_every_path_in_the_layout_exists() -> None:
    paths = layout_paths()
    assert len(paths) > 50
    missing = [
        p for p in paths if not ((ROOT / p).is_dir() if p.endswith("/") else (ROOT / p).is_file())
    ]
    assert not missing, f"CONTRIBUTING.md's layout names paths that do not exist: {missing}"


def test_the_layout_names_every_module() -> None:
    named = set(layout_paths())
    unnamed = sorted(files_to_list() - named)
    assert not unnamed, f"CONTRIBUTING.md's layout leaves out: {unnamed}"
    # A folder's mod.rs is covered by the folder's line.
    for crate in (ROOT / "crates").iterdir():
        for part in ("src", "tests", "examples"):
            for f in (crate / part).rglob("mod.rs"):
                folder = f.parent.relative_to(ROOT).as_posix() + "/"
                assert folder in named, f"CONTRIBUTING.md's layout leaves out {folder}"


def readme_section(title: str) -> str:
    text = README.read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert found, f"README.md has no '## {title}' section"
    return found.group(1)


def test_readme_cli_block_names_every_command() -> None:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    block = readme_section("The CLI")
    missing = [c for c in sub.choices if not re.search(rf"^lloyal {c}\b", block, flags=re.M)]
    assert not missing, f"README's CLI block leaves out: {missing}"


def test_readme_errors_section_names_every_exception() -> None:
    section = readme_section("Errors")
    missing = [name for name in lloyal.errors.__all__ if not re.search(rf"\b{name}\b", section)]
    assert not missing, f"README's Errors section leaves out: {missing}"
    # ... each importable from lloyal, as the section says.
    assert set(lloyal.errors.__all__) <= set(lloyal.__all__)


def test_readme_links_every_example() -> None:
    text = README.read_text()
    folders = sorted(p.name for p in (ROOT / "examples").iterdir() if p.is_dir())
    missing = [f for f in folders if f"(examples/{f})" not in text]
    assert not missing, f"README links no example folder {missing}"


@pytest.mark.parametrize(
    ("index", "prefix"), [(README, "docs/"), (DOCS / "README.md", "")], ids=["README", "docs"]
)
def test_every_docs_page_is_linked(index: Path, prefix: str) -> None:
    text = index.read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    missing = [p for p in pages if f"]({prefix}{p}" not in text]
    assert not missing, f"{index.relative_to(ROOT)} links no page {missing}"


@pytest.mark.parametrize(
    "cls",
    [
        lloyal.Context,
        lloyal.Branch,
        lloyal.BranchStore,
        lloyal.Session,
        lloyal.ProgramState,
        lloyal.Generation,
    ],
    ids=lambda c: c.__name__,
)
def test_every_public_method_has_a_runnable_example(cls: type) -> None:
    """The core classes' public methods each carry a docstring example
    (which the doctest run executes)."""
    import inspect

    missing = []
    for name, obj in vars(cls).items():
        if name.startswith("_") or isinstance(obj, property):
            continue
        fn = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
        if callable(fn) and ">>>" not in (inspect.getdoc(fn) or ""):
            missing.append(name)
    assert not missing, f"{cls.__name__} methods without an example: {missing}"
