#!/usr/bin/env bash
# The device runs owed to issues 63 and 65, one mode per device call (carry .whl: the cp312 wheels of msgspec
# starlette uvicorn gguf llguidance websockets httptools, as the device's README says).
# Modes:
#   verify   (~6 min) the GPU tests of determinism and the experts (tests/test_gpu_determinism.py,
#            tests/test_fused_moe.py, tests/test_moe.py), then (unless VERIFY_TIMINGS=0) the deterministic mode's cost:
#            batch 1 and 256 sequences.
#   families (~8 min) batch-1 decode of the dense 8B beside Gemma-3-12B, Phi-4 and Qwen3-30B-A3B shapes
#            (bench/shapes.py), then 256 sequences offline of the 8B beside Qwen3-30B-A3B.
#   gguf     (issue 64 item 5) llama.cpp's llama-bench and llama-quantize built for CUDA (sm_90) from
#            $LLAMA_SRC (default .scratch/lc.tar.xz: llama-cpp-python 0.3.36's vendored llama.cpp, trimmed to
#            ggml's CPU and CUDA backends, src, common, vendor and tools/{llama-bench,quantize}), or unpacked from
#            .scratch/lcbin.tar.xz (an earlier call's build, which this mode leaves under $OUT in 15 MB parts);
#            then Llama-3.2-1B and (GGUF_SHAPES) Llama-3.1-8B shapes of random weights, quantized to Q4_0 and Q4_K_M
#            by that llama-quantize (tokenizer: .scratch/gg/tok.gguf, tools/make_kquant_bench_gguf.py
#            --tokenizer-only), and bench/gguf_cuda.py on them. Carry .whl and those two .scratch files. ~14 min
#            in all: on a warm machine, run it as GGUF_SHAPES=llama-3.2-1b, then call again at once for the 8B with
#            the built programs still in /tmp/gg (bench/RESULTS.md, sixteenth session, shows the commands).
#   sweep32  (~4 min) the one-row int4 GEMV's configs for GGUF's groups of 32 (tools/sweep_int4_gemv.py --group 32,
#            Llama-3.2-1B and 3.1-8B shapes): the table under $OUT, to merge into nanoinfer/backends/cuda/tuned.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
step() { echo "=== $* ($(date +%T))"; }
grouped_baseline() {  # SECONDS ARGS...: bench/latency.py with the grouped expert kernel at every batch (no GEMVs)
  timeout "$1" python -c "import runpy, sys; from nanoinfer.backends.cuda import fused_moe
fused_moe.few_pairs = lambda *a: False
sys.argv = ['bench/latency.py'] + sys.argv[1:]
runpy.run_path('bench/latency.py', run_name='__main__')" "${@:2}"
}
T="bench/throughput.py --device cuda --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-baseline"
mode=${1:-verify}
if [ "$mode" = verify ]; then
  step "tests on the GPU: determinism (issue 65), grouped experts (issue 63)"
  timeout 280 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_determinism.py tests/test_fused_moe.py \
    tests/test_moe.py > $OUT/tests.txt 2>&1
  tail -30 $OUT/tests.txt
fi
if [ "$mode" = verify ] && [ "${VERIFY_TIMINGS:-1}" = 1 ]; then
  step "issue 65: batch 1, overlap beside deterministic"
  timeout 120 python bench/latency.py --shapes qwen3-0.6b llama-3.2-1b --no-baseline --variants overlap deterministic \
    2>&1 | tail -6
  step "issue 65: 256 sequences, without and with --deterministic"
  for det in "" --deterministic; do
    timeout 60 python $T --shape qwen3-0.6b $det 2>&1 | tail -3
  done
fi
if [ "$mode" = families ]; then
  step "issue 63: batch 1 in the families' shapes"
  timeout 330 python bench/latency.py --shapes llama-3.1-8b gemma-3-12b phi-4 qwen3-30b-a3b --no-baseline \
    --variants overlap 2>&1 | tail -8
  step "issue 63: 256 sequences, dense 8B beside Qwen3-30B-A3B"
  for shape in llama-3.1-8b qwen3-30b-a3b; do
    timeout 120 python $T --shape $shape 2>&1 | tail -3
  done
fi
if [ "$mode" = gguf ]; then
  W=/tmp/gg
  mkdir -p $W/bin
  export PATH=/usr/local/cuda/bin:$PATH
  if [ -f .scratch/lcbin.tar.xz ]; then
    tar xJf .scratch/lcbin.tar.xz -C $W
  else
    step "build llama.cpp for CUDA (sm_90): llama-bench, llama-quantize"
    tar xJf "${LLAMA_SRC:-.scratch/lc.tar.xz}" -C $W
    cmake -S $W/llama.cpp -B $W/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF > $OUT/cmake.txt 2>&1 || { tail -20 $OUT/cmake.txt; exit 1; }
    timeout "${BUILD_S:-450}" cmake --build $W/build --target llama-bench llama-quantize -j 16 > $OUT/build.txt 2>&1
    tail -2 $OUT/build.txt
    cp $W/build/bin/llama-bench $W/build/bin/llama-quantize $W/bin/ || exit 1
    tar cJf - -C $W bin | split -b 15m - $OUT/lcbin.tar.xz.part-
    ls -la $OUT
  fi
  step "GPU tests of the GGUF path: K-quant files on CUDA, the int4 kernels (written-out weights from 256 rows)"
  timeout 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_int4_dequantize.py \
    "tests/test_gguf_formats.py::test_kquant_file_runs_on_cuda" \
    "tests/test_gpu.py::test_int4_mm_matches_its_dequantized_reference" 2>&1 | tail -5
  step "random-weight GGUFs, quantized by llama-quantize"
  files=""
  for shape in ${GGUF_SHAPES:-llama-3.2-1b llama-3.1-8b}; do
    timeout 200 python tools/make_kquant_bench_gguf.py $W/$shape.f16.gguf --shape $shape --mix f16 \
      --tokenizer .scratch/gg/tok.gguf || exit 1
    for q in Q4_0 Q4_K_M; do
      timeout 200 $W/bin/llama-quantize $W/$shape.f16.gguf $W/$shape.$q.gguf $q > $W/quantize.txt 2>&1 || { tail $W/quantize.txt; exit 1; }
      files="$files $W/$shape.$q.gguf"
    done
    rm $W/$shape.f16.gguf
  done
  step "bench/gguf_cuda.py"
  timeout "${BENCH_S:-400}" python bench/gguf_cuda.py $files --llama-bench $W/bin/llama-bench 2>&1 | tee $OUT/gguf_cuda.txt
fi
if [ "$mode" = sweep32 ]; then
  step "the int4 GEMV's configs at groups of 32"
  timeout 400 python tools/sweep_int4_gemv.py --shape llama-3.2-1b llama-3.1-8b --group 32 --out $OUT 2>&1 | tail -20
fi
echo "=== done $(date +%T)"
