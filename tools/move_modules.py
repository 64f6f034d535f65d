"""Move modules to new dotted names and rewrite every reference to them in the repository.

    python tools/move_modules.py MAPPING_FILE        # lines: "old.dotted.name new.dotted.name"

A behaviour-preserving rename for refactors: each file is `git mv`ed (a module's sibling data files, named in
the mapping as paths — "nanoinfer/cpu_native.c nanoinfer/backends/cpu/cpu_native.c" — move as they are); new
packages get an `__init__.py` whose docstring says TODO until written. Then, in every tracked text file:
`from pkg import mod[, ...]` statements that name a moved module are split so the moved ones import from their
new package (under their old local name); every dotted name (`import a.b`, `"a.b.attr"` in monkeypatch strings,
`python -m a.b`) and every path (`a/b.py` in docs and comments) is rewritten.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".yml", ".yaml", ".json", ".ini", ".c", ".h")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / line for line in out.splitlines()]
    # (bench/RESULTS.md is a record of runs at their commits: its paths stay as they were)
    return [f for f in files if f.is_file() and (f.suffix in TEXT or f.name == "run" or "." not in f.name)
            and f.name != "RESULTS.md"]


def module_path(dotted: str) -> Path:
    return ROOT / (dotted.replace(".", "/") + ".py")


def rewrite_import_froms(source: str, moves: dict[str, str]) -> str:
    """`from P import a, b as c` where P.a moved: the moved names import from their new package."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
            continue
        moved = [a for a in node.names if f"{node.module}.{a.name}" in moves]
        if not moved:
            continue
        first = lines[node.lineno - 1]
        indent = first[:len(first) - len(first.lstrip())]
        new = []
        kept = [a for a in node.names if a not in moved]
        if kept:
            new.append(f"{indent}from {node.module} import " + ", ".join(
                a.name + (f" as {a.asname}" if a.asname else "") for a in kept) + "\n")
        for a in moved:
            package, _, base = moves[f"{node.module}.{a.name}"].rpartition(".")
            local = a.asname or a.name
            new.append(f"{indent}from {package} import {base}" + (f" as {local}" if local != base else "") + "\n")
        edits.append((node.lineno - 1, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        tail = lines[end - 1]
        code_end = tail.rstrip("\n")
        # (a comment after the statement's last line stays, on the first new line)
        comment = ""
        if "#" in code_end and ")" not in code_end.split("#", 1)[1]:
            comment = "  #" + code_end.split("#", 1)[1]
        if comment and new:
            new[0] = new[0].rstrip("\n") + comment + "\n"
        lines[start:end] = new
    return "".join(lines)


def rewrite_names(text: str, moves: dict[str, str], paths: dict[str, str]) -> str:
    """Every path, then every dotted name, in one pass each (a new name is never rewritten again)."""
    for table, before in ((paths, r"(?<![\w/.])"), (moves, r"(?<![\w.])")):
        if table:
            pattern = before + "(" + "|".join(map(re.escape, sorted(table, key=len, reverse=True))) + r")(?![\w])"
            text = re.sub(pattern, lambda m: table[m.group(1)], text)
    return text


def main(mapping_file: str) -> None:
    moves, paths = {}, {}
    for line in Path(mapping_file).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        old, new = line.split()
        if "/" in old:  # a data file, moved as it is
            paths[old] = new
        else:
            moves[old] = new
            paths[str(module_path(old).relative_to(ROOT))] = str(module_path(new).relative_to(ROOT))
    for old, new in paths.items():
        target = ROOT / new
        for parent in reversed(target.relative_to(ROOT).parents[:-1]):
            folder = ROOT / parent
            folder.mkdir(exist_ok=True)
            init = folder / "__init__.py"
            if not init.exists():
                init.write_text('"""TODO: what this package holds."""\n')
                subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
        subprocess.run(["git", "mv", old, new], cwd=ROOT, check=True)
    for file in tracked():
        text = file.read_text(encoding="utf-8", errors="surrogateescape")
        new = rewrite_names(text, moves, paths)
        if file.suffix == ".py":
            new = rewrite_import_froms(new, moves)
        if new != text:
            file.write_text(new, encoding="utf-8", errors="surrogateescape")


if __name__ == "__main__":
    main(sys.argv[1])
