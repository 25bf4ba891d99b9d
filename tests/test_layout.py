"""scripts/check_layout.py (in ``make lint``): the rules it enforces, each
shown failing on a small tree, and the real tree passing (no model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def layout() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts/check_layout.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layout"] = module
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _empty_pkg(tmp_path: Path) -> Path:
    return _tree(tmp_path / "pkg", {"__init__.py": ""})


def _empty_core(tmp_path: Path) -> Path:
    return _tree(tmp_path / "src", {"lib.rs": ""})


def test_the_real_tree_passes(layout: ModuleType) -> None:
    assert layout.problems() == []


def test_folders_that_use_each_other_through_different_files(
    layout: ModuleType, tmp_path: Path
) -> None:
    # a/x.rs uses b/y.rs and b/z.rs uses a/w.rs: no file circle, a folder one.
    core = _tree(
        tmp_path / "src",
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a/mod.rs": "mod w;\nmod x;\npub use w::W;\n",
            "a/w.rs": "pub struct W;\n",
            "a/x.rs": "use crate::b::y::Y;\n",
            "b/mod.rs": "pub(crate) mod y;\nmod z;\n",
            "b/y.rs": "pub struct Y;\n",
            "b/z.rs": "use crate::a::W;\n",
        },
    )
    found = layout.problems(core, _empty_pkg(tmp_path))
    assert len(found) == 1, found
    assert "folders use each other" in found[0]
    assert str(core / "a") in found[0]
    assert str(core / "b") in found[0]


def test_a_name_a_mod_rs_re_exports_is_a_use_of_its_file(
    layout: ModuleType, tmp_path: Path
) -> None:
    # `crate::a::W` is a use of a/w.rs (not of a/mod.rs): a/w.rs <-> c.rs.
    core = _tree(
        tmp_path / "src",
        {
            "lib.rs": "mod a;\nmod c;\n",
            "a/mod.rs": "mod w;\npub use w::{W as Renamed, Other};\n",
            "a/w.rs": "use crate::c::C;\npub struct W;\npub struct Other;\n",
            "c.rs": "use crate::a::Renamed;\npub struct C;\n",
        },
    )
    graph = layout.rust_graph(core)
    assert graph[core / "c.rs"] == {core / "a/w.rs"}
    assert graph[core / "a/mod.rs"] == {core / "a/w.rs"}
    found = layout.problems(core, _empty_pkg(tmp_path))
    assert any("import circle" in p and "w.rs" in p and "c.rs" in p for p in found), found


def test_type_only_imports_count(layout: ModuleType, tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "m.py": "from pkg.n import N\n",
            "n.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.m import M\nN = 1\n"
            ),
        },
    )
    found = layout.problems(_empty_core(tmp_path), pkg)
    assert found == [f"python: import circle among {pkg / 'm.py'}, {pkg / 'n.py'}"]


def test_python_folders_that_use_each_other(layout: ModuleType, tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/one.py": "from pkg.b.two import TWO\n",
            "a/three.py": "THREE = 3\n",
            "b/__init__.py": "",
            "b/two.py": "TWO = 2\n",
            "b/four.py": "from pkg.a.three import THREE\n",
        },
    )
    found = layout.problems(_empty_core(tmp_path), pkg)
    assert len(found) == 1, found
    assert "folders use each other" in found[0]


@pytest.mark.parametrize(
    ("suffix", "reason"),
    [
        (".py", '"""A module.\n\nLength: one class, whose examples are most of it.\n"""\n'),
        (".rs", "//! A module.\n//!\n//! Length: one table, generated elsewhere.\n"),
    ],
)
def test_files_over_the_limit_need_a_written_reason(
    layout: ModuleType, tmp_path: Path, suffix: str, reason: str
) -> None:
    core, pkg = _empty_core(tmp_path), _empty_pkg(tmp_path)
    line = "x = 1\n" if suffix == ".py" else "const X: u8 = 1;\n"
    limit = layout.MAX_LINES
    target = (pkg if suffix == ".py" else core) / f"big{suffix}"
    target.write_text(line * (limit + 1))
    found = layout.problems(core, pkg)
    assert len(found) == 1, found
    assert f"big{suffix} has {limit + 1} lines" in found[0]
    target.write_text(reason + line * (limit + 1))
    assert layout.problems(core, pkg) == []
    target.write_text(line * limit)
    assert layout.problems(core, pkg) == []


def test_the_bindings_crate_is_checked_too(layout: ModuleType, tmp_path: Path) -> None:
    # branch.rs <-> context.rs in the PyO3 crate: a circle like any other.
    bindings = _tree(
        tmp_path / "py" / "src",
        {
            "lib.rs": "mod branch;\nmod context;\n",
            "branch.rs": "use crate::context::f32_slice;\npub struct Registry;\n",
            "context.rs": "use crate::branch::Registry;\npub fn f32_slice() {}\n",
        },
    )
    core = _tree(tmp_path / "core" / "src", {"lib.rs": ""})
    found = layout.problems(core, _empty_pkg(tmp_path), bindings)
    assert len(found) == 1, found
    assert found[0].startswith("bindings: import circle")
