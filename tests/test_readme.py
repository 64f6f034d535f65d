"""The README's Python examples run as written, on the default model, and print what they say."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python_examples() -> list[str]:
    """The README's ```python blocks that are whole programs (they import what they use)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    return [b for b in blocks if b.startswith(("from nanoinfer import", "import asyncio"))]


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_offline_example_prints_each_completion(smollm2_gguf):
    (example,) = [b for b in python_examples() if "LLM()" in b]
    lines = run(example).strip().splitlines()
    assert lines and lines[-1].endswith((" length", " stop"))


@pytest.mark.slow
def test_the_async_example_prints_the_stats_on_a_line_of_their_own(smollm2_gguf):
    (example,) = [b for b in python_examples() if "AsyncEngine" in b]
    text, stats = run(example).rstrip("\n").rsplit("\n", 1)
    assert text.strip() and stats.startswith("{'running': ") and stats.endswith("}")
