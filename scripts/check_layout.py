"""Check the source layout rules of CONTRIBUTING.md, as a reader sees the code:

- no import circle among the core crate's modules, the bindings crate's
  (``lloyal-py``) or ``python/lloyal``'s, file by file;
- no circle among their folders either: each top-level folder (``engine/``,
  ``branch/``, ``server/``, ...) counts as one module, so two folders that
  use each other through different files are a circle too;
- no source file over the line limit (Rust and Python alike), unless its
  module docs give the reason in a paragraph that starts ``Length:``.

A module is a file. In Rust, ``crate::a::b::C`` and ``super::b`` name the
deepest file along the path; a name a ``mod.rs`` (or ``lib.rs``) re-exports
resolves to the file that defines it (``crate::engine::Context`` is a use of
``engine/handle.rs``), and a ``mod.rs``'s own re-exports count as its uses.
In Python every import counts, those under ``if TYPE_CHECKING:`` too: a
reader has to follow them all the same.

Run: ``python scripts/check_layout.py`` (``make lint`` does). Exits 1 and
lists every circle and oversized file it finds.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "crates" / "lloyal-core" / "src"
BINDINGS = ROOT / "crates" / "lloyal-py" / "src"
PYPKG = ROOT / "python" / "lloyal"
MAX_LINES = 600
_LENGTH_REASON = re.compile(r"^\s*(?://!|#|)\s*Length:", re.MULTILINE)

_PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
_GROUP = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^}]*)\}")


def _rust_module_dir(path: Path) -> Path:
    """The directory that holds ``path``'s child modules."""
    return path.parent if path.name in ("mod.rs", "lib.rs") else path.with_suffix("")


_REEXPORT = re.compile(r"\bpub(?:\([a-z]+\))?\s+use\s+(?:self::)?([a-z_][a-z0-9_]*)::([^;]+);")


def _reexports(path: Path) -> dict[str, Path]:
    """Names a ``mod.rs`` / ``lib.rs`` re-exports from its children, with the
    file each comes from (``pub use handle::{Context, Hold as H}``)."""
    found: dict[str, Path] = {}
    text = _strip_rust_tests(path.read_text(encoding="utf-8"))
    for child, rest in _REEXPORT.findall(text):
        target = _rust_resolve(path.parent, [child], follow=False)
        if target is None:
            continue
        rest = rest.strip()
        names = rest[1:-1].split(",") if rest.startswith("{") else [rest]
        for name in names:
            name = name.strip()
            if not name:
                continue
            original, _, alias = (p.strip() for p in name.partition(" as "))
            inner = original.split("::")[:-1]
            deeper = _rust_resolve(_rust_module_dir(target), inner, follow=False)
            found[(alias or original).split("::")[-1]] = deeper or target
    return found


def _rust_resolve(start: Path, parts: list[str], follow: bool = True) -> Path | None:
    """The deepest file module along ``parts`` from directory ``start``; with
    ``follow``, a name a ``mod.rs`` re-exports is followed to its file."""
    found = None
    here = start
    for i, part in enumerate(parts):
        for candidate in (here / f"{part}.rs", here / part / "mod.rs"):
            if candidate.is_file():
                found = candidate
                here = _rust_module_dir(candidate)
                break
        else:
            if follow and found is not None and found.name in ("mod.rs", "lib.rs"):
                return _reexports(found).get(part, found)
            if follow and found is None and i == 0 and (start / "lib.rs").is_file():
                return _reexports(start / "lib.rs").get(part)
            break
    return found


def _strip_rust_tests(text: str) -> str:
    """Drop ``#[cfg(test)] mod tests { ... }`` (``use super::*`` there is the
    file itself) and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: cut.start()] if cut else text


def rust_graph(core: Path = CORE) -> dict[Path, set[Path]]:
    graph: dict[Path, set[Path]] = {}
    for path in sorted(core.rglob("*.rs")):
        text = _strip_rust_tests(path.read_text(encoding="utf-8"))
        parent_dir = path.parent if path.name != "mod.rs" else path.parent.parent
        refs: list[tuple[str, list[str]]] = []
        for root, group_prefix, items in _GROUP.findall(text):
            prefix = [p for p in group_prefix.split("::") if p]
            for item in items.split(","):
                name = item.strip().split(" as ")[0].strip()
                if name and name != "self":
                    refs.append((root, [*prefix, *name.split("::")]))
                elif name == "self":
                    refs.append((root, prefix))
        for root, rest in _PATH.findall(text):
            refs.append((root, [p for p in rest.split("::") if p]))
        deps = set()
        for root, parts in refs:
            base = core if root == "crate" else parent_dir
            target = _rust_resolve(base, parts)
            if root == "super" and target is None:
                target = parent_dir / "mod.rs" if (parent_dir / "mod.rs").is_file() else None
            if target is not None and target != path:
                deps.add(target)
        # A mod.rs / lib.rs uses what it re-exports (`mod child;` alone
        # declares a child: not a use of it).
        if path.name in ("mod.rs", "lib.rs"):
            deps.update(t for t in _reexports(path).values() if t != path)
        graph[path] = deps
    return graph


def _python_imports(path: Path, pkg: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (type-only and lazy
    imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = _py_name(path, pkg).rsplit(".", node.level)[0]
                if path.name == "__init__.py" and node.level == 1:
                    package = _py_name(path, pkg)
                module = f"{package}.{module}" if module else package
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _py_name(path: Path, pkg: Path) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_graph(pkg: Path = PYPKG) -> dict[Path, set[Path]]:
    modules = {_py_name(p, pkg): p for p in pkg.rglob("*.py")}
    graph: dict[Path, set[Path]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _python_imports(path, pkg):
            # The deepest module the import names (`lloyal.x.Y` -> lloyal.x).
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = modules.get(".".join(parts)) if parts else None
            # A package's __init__ is imported first by any of its modules:
            # only an explicit use of it counts.
            if target is not None and target != path and ".".join(parts) != pkg.name:
                deps.add(target)
        graph[path] = deps
        del name
    return graph


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []

    def strong(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def folders(graph: dict[Path, set[Path]], root: Path) -> dict[Path, set[Path]]:
    """``graph`` with each top-level folder under ``root`` as one node (a
    file directly under ``root`` stays itself); uses inside a folder vanish."""

    def node(path: Path) -> Path:
        rel = path.relative_to(root)
        return root / rel.parts[0] if len(rel.parts) > 1 else path

    folded: dict[Path, set[Path]] = {}
    for path, deps in graph.items():
        here = node(path)
        folded.setdefault(here, set()).update(d for d in map(node, deps) if d != here)
    return folded


def too_long(path: Path) -> int | None:
    """``path``'s line count when over the limit with no ``Length:`` reason
    in its module docs."""
    text = path.read_text(encoding="utf-8")
    n = len(text.splitlines())
    if n <= MAX_LINES:
        return None
    if path.suffix == ".py":
        docs = ast.get_docstring(ast.parse(text)) or ""
    else:
        docs = "\n".join(line for line in text.splitlines() if line.startswith("//!"))
    return None if _LENGTH_REASON.search(docs) else n


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def problems(core: Path = CORE, pkg: Path = PYPKG, bindings: Path = BINDINGS) -> list[str]:
    """Every rule broken in the crates at ``core`` and ``bindings`` and the
    package at ``pkg``."""
    found = []
    for what, graph, root in (
        ("core", rust_graph(core), core),
        ("bindings", rust_graph(bindings), bindings),
        ("python", python_graph(pkg), pkg),
    ):
        for component in cycles(graph):
            found.append(f"{what}: import circle among {', '.join(map(_show, component))}")
        for component in cycles(folders(graph, root)):
            if any(p.is_dir() for p in component):
                found.append(f"{what}: folders use each other: {', '.join(map(_show, component))}")
        for path in sorted(graph):
            n = too_long(path)
            if n is not None:
                found.append(
                    f"{what}: {_show(path)} has {n} lines (limit {MAX_LINES},"
                    " or a 'Length:' paragraph in its module docs saying why)"
                )
    return found


def main() -> int:
    found = problems()
    for p in found:
        print(p)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
