"""The reader's path: which of the project's files, and how many of their statements, one
default request executes (the measure of "a reader can follow one request in a handful of files").

    python tools/reader_path.py [--model DIR] [--json FILE]

Runs `LLM(model, device="cpu").generate(["The capital of France is"], SamplingParams(max_tokens=8,
temperature=0))` under coverage (every thread) — on the default model (a GGUF), or with `--model` on
another checkpoint (a plain Hugging Face directory of safetensors: the path a reader of nano-vllm would
compare) — then prints one line per file of `nanoinfer/` and `runtime/` that ran (statements executed,
the file's lines) and the totals. Loading the model counts: it is part of the request's path from checkpoint to text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nanoinfer", "runtime")


class FileRun(NamedTuple):
    path: str  # relative to the repository
    statements: int  # executed
    lines: int  # of the whole file


def measure(model: str | None = None) -> list[FileRun]:
    import coverage

    cov = coverage.Coverage(source=[str(ROOT / p) for p in PACKAGES], concurrency=["thread"], data_file=None)
    cov.start()
    from nanoinfer import LLM, SamplingParams

    llm = LLM(model, device="cpu", progress=False)
    try:
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    finally:
        llm.close()
        cov.stop()
    data = cov.get_data()
    runs = []
    for file in sorted(data.measured_files()):
        executed = data.lines(file) or []
        if not executed:
            continue
        _, statements, _, _, _ = cov.analysis2(file)
        ran = len(set(executed) & set(statements))
        runs.append(FileRun(str(Path(file).resolve().relative_to(ROOT)), ran,
                            len(Path(file).read_text(encoding="utf-8").splitlines())))
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    parser.add_argument("--json", help="also write the files and totals here")
    args = parser.parse_args(argv)
    runs = measure(args.model)
    width = max(len(r.path) for r in runs)
    for r in runs:
        print(f"{r.path:<{width}}  {r.statements:>5} statements  {r.lines:>5} lines")
    total = {"files": len(runs), "statements": sum(r.statements for r in runs), "lines": sum(r.lines for r in runs)}
    print(f"{'total':<{width}}  {total['statements']:>5} statements  {total['lines']:>5} lines in {total['files']} files")
    if args.json:
        Path(args.json).write_text(json.dumps({**total, "per_file": [r._asdict() for r in runs]}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
