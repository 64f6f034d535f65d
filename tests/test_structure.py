"""The code keeps the shape issue 32 gave it: no class over 15 methods or 300 lines, no function
over 60 lines, outside the GPU kernels (Triton's @jit functions, written as one body each)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _is_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(node, "decorator_list", ()))


def oversized() -> list[str]:
    found = []
    for path in sorted([*ROOT.glob("nanoinfer/**/*.py"), *ROOT.glob("runtime/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            where, lines = f"{path.relative_to(ROOT)}:{getattr(node, 'name', '')}", 0
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if methods > 15 or lines > 300:
                    found.append(f"class {where}: {methods} methods, {lines} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > 60 and not _is_kernel(node):
                found.append(f"function {where}: {lines} lines")
    return found


def test_no_class_or_function_is_too_wide_to_read():
    assert oversized() == []
