"""How many instructions a one-row GEMV kernel spends per weight, read from its sm_90 SASS, no GPU.

    python -m bench.sass_count [int4|int8|bf16 ...] [--group 128]

Compiles the one-row kernels of nanoinfer.backends.cuda.gemv and int4_gemv for an H100 (sm_90) with the ptxas that ships in
Triton's wheel, as the launcher would for real shapes (every pointer and size divisible by
16), disassembles them with the wheel's cuobjdump, finds the main loop (the backward branch)
and prints, for each config of the kernel's autotune list, the loop's instructions per packed
word (int4: eight weights) or per weight a thread handles, and the most frequent opcodes.

Why: a batch-1 GEMV whose loop needs more lane-instructions per byte than an SM can issue
(128 a clock) is bound by issue, not by memory; on an H100 at 3 TB/s one SM must take ~3.2
int4 words or ~13 int8 weights a clock. bench/RESULTS.md (twenty-third session) has what this
showed about the int4 kernel (62 instructions a word, 38 after) and the speed it bought.
Needs Triton (3.6) only; runs on the CPU machine.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanoinfer.backends.cuda import gemv, int4_gemv

_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def compile_sm90(fn, signature: dict, constexprs: dict, **options):
    """`fn` compiled for sm_90 with every pointer and i32 argument divisible by 16 (as the launcher
    specializes real shapes: without it loads are not vectorized and the count means nothing)."""
    # Arguments left at their defaults (an epilogue's pointers and flags) are compiled as the
    # launcher compiles them when they are not passed: as those constants.
    defaults = {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    constexprs = {**{n: v for n, v in defaults.items() if n not in signature}, **constexprs}
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
             if t.startswith("*") or t == "i32"}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main_loop(cubin: bytes) -> list[str]:
    """The instructions from the target of the first backward branch to that branch."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2)) for m in _INSTRUCTION.finditer(sass)]
    for addr, ins in lines:
        target = re.search(r"0x([0-9a-f]+)", ins) if "BRA" in ins else None
        if target and int(target.group(1), 16) < addr:
            return [i for a, i in lines if int(target.group(1), 16) <= a <= addr]
    return []


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def _cases(kind: str, group: int):
    """(fn, signature, constexprs, num_warps, num_stages, units a thread handles per iteration) per config."""
    common = {"x_ptr": "*bf16", "out_ptr": "*bf16"}
    if kind == "int4":
        fn = int4_gemv._int4_gemv_kernel
        sig = {**common, "w_ptr": "*i32", "scale_ptr": "*fp32", "min_ptr": "*fp32", "N": "i32", "K": "i32",
               "stride_wn": "i32", "stride_sn": "i32", "EXP": "i32",
               "res_ptr": "*bf16"}
        for c in fn.configs:
            n, g, split = c.kwargs["BLOCK_N"], c.kwargs["GROUPS"], c.kwargs["SPLIT"]
            words = n * split * min(group // 8, 16) if c.kwargs["TC"] else n * g * (group // 8)
            yield c, fn.fn, sig, dict(GROUP=group, HALF=False, **c.kwargs), words / (32 * c.num_warps)
        return
    fn = gemv._gemv_kernel
    sig = {**common, "w_ptr": "*i8" if kind == "int8" else "*bf16", "scale_ptr": "*fp32", "N": "i32", "K": "i32",
           "stride_wn": "i32", "stride_xm": "i32", "stride_om": "i32", "W_BYTES": "i32", "norm_ptr": "*bf16",
           "res_ptr": "*bf16", "eps": "fp32", "push_ptr": "*i64"}
    for c in fn.configs:
        n, k = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        flags = dict(HAS_SCALE=kind == "int8", INT8=kind == "int8", ROWS=1, NORM=False, SILU=False, RESIDUAL=False,
                     PUSH=0, BLOCK_N=n, BLOCK_K=k, PDL=False, LINE=128 // (1 if kind == "int8" else 2))
        yield c, fn.fn, sig, flags, n * k / (32 * c.num_warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", default=["int4", "int8", "bf16"], choices=["int4", "int8", "bf16"])
    parser.add_argument("--group", type=int, default=128, help="int4: inputs per scale")
    args = parser.parse_args()
    for kind in args.kinds:
        unit = "word" if kind == "int4" else "weight"
        print(f"{kind}: main-loop instructions per {unit} a thread handles (sm_90)")
        for config, fn, sig, constexprs, units in _cases(kind, args.group):
            kernel = compile_sm90(fn, sig, constexprs, num_warps=config.num_warps, num_stages=config.num_stages)
            body = main_loop(kernel.asm["cubin"])
            top = ", ".join(f"{op} {n}" for op, n in collections.Counter(map(_opcode, body)).most_common(6))
            shape = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
            print(f"  {shape:22s} warps={config.num_warps}  {len(body) / units:6.1f}  ({len(body)} in the loop: {top})")


if __name__ == "__main__":
    main()
