"""Check the source layout rules of CONTRIBUTING.md: no import circles among
the core crate's modules or among ``python/lloyal``'s modules, and no core
source file over the line limit.

A module is a file. In Rust, ``crate::a::b::C`` and ``super::b`` name the
deepest file that exists along the path (a ``mod.rs`` holds only declarations
and re-exports, so ``crate::engine::Worker`` is a use of ``engine/mod.rs``,
which uses ``engine/worker.rs``). In Python, imports under ``if
TYPE_CHECKING:`` are ignored: they never run.

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
PYPKG = ROOT / "python" / "lloyal"
MAX_LINES = 650

_PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
_GROUP = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^}]*)\}")


def _rust_module_dir(path: Path) -> Path:
    """The directory that holds ``path``'s child modules."""
    return path.parent if path.name in ("mod.rs", "lib.rs") else path.with_suffix("")


def _rust_resolve(start: Path, parts: list[str]) -> Path | None:
    """The deepest file module along ``parts`` from directory ``start``."""
    found = None
    here = start
    for part in parts:
        for candidate in (here / f"{part}.rs", here / part / "mod.rs"):
            if candidate.is_file():
                found = candidate
                here = _rust_module_dir(candidate)
                break
        else:
            break
    return found


def _strip_rust_tests(text: str) -> str:
    """Drop ``#[cfg(test)] mod tests { ... }`` (``use super::*`` there is the
    file itself) and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: cut.start()] if cut else text


def rust_graph() -> dict[Path, set[Path]]:
    graph: dict[Path, set[Path]] = {}
    for path in sorted(CORE.rglob("*.rs")):
        text = _strip_rust_tests(path.read_text())
        own_dir = _rust_module_dir(path)
        parent_dir = path.parent if path.name not in ("mod.rs",) else path.parent.parent
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
            base = CORE if root == "crate" else parent_dir
            target = _rust_resolve(base, parts)
            if root == "super" and target is None:
                target = parent_dir / "mod.rs" if (parent_dir / "mod.rs").is_file() else None
            if target is not None and target != path:
                deps.add(target)
        # `mod child;` declares a child: not a use of it.
        graph[path] = deps
        del own_dir
    return graph


def _python_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If):
            test = node.test
            is_tc = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
            )
            for child in node.body:
                visit(child, typing_only or is_tc)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if not typing_only:
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    package = _py_name(path).rsplit(".", node.level)[0]
                    if path.name == "__init__.py" and node.level == 1:
                        package = _py_name(path)
                    module = f"{package}.{module}" if module else package
                names.add(module)
                names.update(f"{module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return names


def _py_name(path: Path) -> str:
    rel = path.relative_to(PYPKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_graph() -> dict[Path, set[Path]]:
    modules = {_py_name(p): p for p in PYPKG.rglob("*.py")}
    graph: dict[Path, set[Path]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _python_imports(path):
            # The deepest module the import names (`lloyal.x.Y` -> lloyal.x).
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = modules.get(".".join(parts)) if parts else None
            # A package's __init__ is imported first by any of its modules:
            # only an explicit use of it counts.
            if target is not None and target != path and ".".join(parts) != "lloyal":
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


def main() -> int:
    problems = []
    for what, graph in (("core", rust_graph()), ("python", python_graph())):
        for component in cycles(graph):
            names = ", ".join(str(p.relative_to(ROOT)) for p in component)
            problems.append(f"{what}: import circle among {names}")
    for path in sorted(CORE.rglob("*.rs")):
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            problems.append(f"core: {path.relative_to(ROOT)} has {n} lines (limit {MAX_LINES})")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
