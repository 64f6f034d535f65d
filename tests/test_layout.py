"""The tree's layout as docs/ARCHITECTURE.md states it, computed from the code: no import cycle (imports inside
functions and under TYPE_CHECKING count: a cycle a reader must untangle is one whatever its timing; importing a.b.c
runs a and a.b's `__init__` too), each module name used once, no module over 500 lines, and `nanoinfer` never
importing `runtime` (its `__init__` hands out the public runtime names — LLM, AsyncEngine — through
importlib on first use, by design: not an import this reads)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nanoinfer", "runtime")
MAX_LINES = 500
# Modules still over MAX_LINES: each may only shrink (none since the CUDA linear layer was split by kernel).
STILL_LONG: dict[str, int] = {}


def modules() -> dict[str, Path]:
    """Every module of the two packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports anywhere in its file: `from P import m` names module P.m where
    that is one, else P; and the packages each of them is in (whose `__init__` runs first), but `name`'s own."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # (relative: from its own package)
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                target = f"{module}.{alias.name}"
                out.add(target if target in known else module)
    # Importing a.b.c runs the packages a and a.b first: their __init__ modules are imported too (but the
    # importer's own packages, which ran before it).
    parents = {".".join(m.split(".")[:i]) for m in out for i in range(1, m.count(".") + 1)}
    out |= {p for p in parents if not name.startswith(p + ".")}
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_nanoinfer_never_imports_runtime():
    known = modules()
    upward = {name: sorted(m for m in imports(name, path, known) if m.startswith("runtime"))
              for name, path in known.items() if name.startswith("nanoinfer")}
    assert {name: ups for name, ups in upward.items() if ups} == {}


def test_each_module_name_is_used_once():
    names: dict[str, list[str]] = {}
    for name in modules():
        names.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    assert {short: full for short, full in names.items() if len(full) > 1} == {}


def sources() -> dict[str, Path]:
    """Every module by dotted name, and every C source and header by its path (kernels count too)."""
    c_files = {str(p.relative_to(ROOT)): p for package in PACKAGES for ext in ("*.c", "*.h")
               for p in sorted((ROOT / package).rglob(ext))}
    return {**modules(), **c_files}


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in sources().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert {name: n for name, n in long.items() if n > STILL_LONG.get(name, MAX_LINES)} == {}


def test_the_line_count_sees_the_c_kernels():
    assert "nanoinfer/backends/cpu/cpu_native.c" in sources()
