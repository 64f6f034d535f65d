"""Reading a GGUF's header: NanoInfer's read_gguf against gguf-py's GGUFReader, wall time and
peak RSS growth, each case in a fresh process.

    python bench/gguf_header.py [GGUF ...]    # default: the default model

For each file, "read" is the header alone (open_gguf; the baseline: gguf-py's GGUFReader and
every field's contents(), what the loader used to read through it, put in a GGUFFile), and "load
header" what a load reads before the weights: that, then the config and the tokenizer
(gguf_config + Tokenizer.from_gguf, the same code for both). Two hostile headers follow (made
in a temporary directory): a million empty strings (8 MB), and a million one-character strings
of 3 UTF-8 bytes (11 MB, the most Python memory per file byte).
The peak is the process's VmHWM, reset just before the case runs.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ONE_CASE = r"""
import json, re, sys, time
from pathlib import Path

import gguf, numpy as np
from nanoinfer.loaders.gguf import gguf_config, open_gguf
from nanoinfer.gguf_file import GGUFFile, TensorInfo, read_gguf
from nanoinfer.text.tokenizer import Tokenizer

reader_name, path, whole_load = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "load"


def through_gguf_py(path):
    reader = gguf.GGUFReader(path)
    fields = {}
    for name, f in reader.fields.items():
        if not name.startswith("GGUF."):
            value = f.contents()
            numeric = f.types[0] == gguf.GGUFValueType.ARRAY and f.types[-1] != gguf.GGUFValueType.STRING
            fields[name] = np.array(value, dtype=f.parts[f.data[0]].dtype) if numeric and f.data else value
    tensors = tuple(TensorInfo(t.name, t.tensor_type, tuple(t.shape.tolist()), t.n_elements, t.n_bytes,
                               t.data_offset, t.data) for t in reader.tensors)
    return GGUFFile(path, fields, tensors, int(reader.alignment), reader.data_offset)


def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


open("/proc/self/clear_refs", "w").write("5")  # (VmHWM restarts at the current RSS)
before, start = status("VmRSS"), time.perf_counter()
header = open_gguf(path) if reader_name == "read_gguf" else through_gguf_py(path)
if whole_load:
    cfg, tokenizer = gguf_config(header, path), Tokenizer.from_gguf(header, path)
print(json.dumps({"seconds": time.perf_counter() - start, "growth": status("VmHWM") - before}))
"""


def one(reader: str, path: Path, case: str) -> dict:
    done = subprocess.run([sys.executable, "-c", ONE_CASE, reader, str(path), case], capture_output=True, text=True,
                          cwd=ROOT, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def strings_gguf(path: Path, count: int, string: bytes) -> Path:
    """A header of one key holding `count` copies of `string`."""
    key = b"tokenizer.ggml.tokens"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, 8, count) + (struct.pack("<Q", len(string)) + string) * count)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    if not args.files:
        from nanoinfer.hub import DEFAULT_MODEL, resolve_model_name

        args.files = [Path(resolve_model_name(DEFAULT_MODEL))]
    with tempfile.TemporaryDirectory() as scratch:
        cases = [(path.name, path, case) for path in args.files for case in ("read", "load")]
        cases += [("1M empty strings", strings_gguf(Path(scratch) / "empty.gguf", 1 << 20, b""), "read"),
                  ("1M '✓' strings", strings_gguf(Path(scratch) / "check.gguf", 1 << 20, "✓".encode()), "read")]
        print("| file | MB | what | reader | seconds | peak RSS growth, MB |\n|---|---|---|---|---|---|")
        for name, path, case in cases:
            for reader in ("gguf-py", "read_gguf"):
                result = one(reader, path, case)
                print(f"| {name} | {path.stat().st_size / 2**20:.1f} | {'load header' if case == 'load' else 'read'} "
                      f"| {reader} | {result['seconds']:.2f} | {result['growth'] / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
