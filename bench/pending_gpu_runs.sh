#!/usr/bin/env bash
# The device runs owed to issues 63 and 65, one mode per device call (carry .whl: the cp312 wheels of msgspec
# starlette uvicorn gguf llguidance websockets httptools, as the device's README says).
# Modes:
#   verify   (~6 min) the GPU tests of determinism and the experts (tests/test_gpu_determinism.py,
#            tests/test_fused_moe.py, tests/test_moe.py), then the deterministic mode's cost: batch 1 and 256 sequences.
#   families (~8 min) batch-1 decode of the dense 8B beside Gemma-3-12B, Phi-4 and Qwen3-30B-A3B shapes
#            (bench/shapes.py), then 256 sequences offline of the 8B beside Qwen3-30B-A3B.
#   layers-short (~3.5 min) the first two steps of `layers` only, shorter.
#   moe-decode (~5 min) the decode GEMVs of the experts (nanoinfer/backends/cuda/expert_gemv.py): the experts' tests,
#            their tiles and the grouped kernel beside them (bench/moe_kernels.py), batch 1 of Qwen3-30B-A3B.
#   moe-fp8  (~7 min) fp8 experts (nanoinfer.quant.quantized.ExpertStack): batch 1 of the dense 8B, Qwen3-30B-A3B and
#            Mixtral-8x7B in fp8 (Mixtral's bf16 does not fit an H100), then 256 sequences of the 8B beside Mixtral.
#   moe-all  (~9 min) moe-decode's tests and batch-1 runs, then moe-fp8's, each step shorter.
#   fp8-oom  (~6 min) why 256 sequences of fp8 weights ran out of memory in CUDA-graph capture (thirteenth session:
#            Mixtral-8x7B and the dense 8B alike, the graphs' pool 5.7-6.1 GiB): the 8B in fp8 with the weights
#            quantized after a bf16 model (the path before layer-by-layer quantizing), with expandable segments,
#            and bf16 as the control; then batch 1 of Qwen3-30B-A3B with the down GEMV's new tile, beside the grouped
#            kernel at every batch.
#   layers   (~6 min) CUDA's layer parts for Gemma and MoE: their tests (tests/test_row_kernels.py, the experts',
#            Gemma's on CUDA), batch 1 of the 8B beside Gemma-3-12B and Qwen3-30B-A3B, the grouped-expert
#            kernels' tiles (bench/moe_kernels.py), 256 sequences of Qwen3-30B-A3B.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
step() { echo "=== $* ($(date +%T))"; }
T="bench/throughput.py --device cuda --num-seqs 256 --input-len 100 1024 --output-len 100 1024 --no-baseline"
mode=${1:-verify}
if [ "$mode" = verify ]; then
  step "tests on the GPU: determinism (issue 65), grouped experts (issue 63)"
  timeout 280 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_determinism.py tests/test_fused_moe.py \
    tests/test_moe.py > $OUT/tests.txt 2>&1
  tail -30 $OUT/tests.txt
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
if [ "$mode" = layers-short ]; then
  step "issue 63: CUDA's layer parts for Gemma and MoE"
  timeout 140 python -m pytest -q -x -p no:cacheprovider -rfE tests/test_row_kernels.py tests/test_fused_moe.py \
    tests/test_moe.py tests/test_gpu.py::test_gemma_on_cuda_with_graphs_agrees_with_transformers > $OUT/tests.txt 2>&1
  tail -8 $OUT/tests.txt
  step "issue 63: batch 1"
  timeout 70 python bench/latency.py --shapes gemma-3-12b qwen3-30b-a3b --no-baseline --variants overlap 2>&1 | tail -3
fi
if [ "$mode" = layers ]; then
  step "issue 63: CUDA's layer parts for Gemma and MoE"
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE tests/test_row_kernels.py tests/test_fused_moe.py \
    tests/test_moe.py tests/test_gpu.py::test_gemma_on_cuda_with_graphs_agrees_with_transformers > $OUT/tests.txt 2>&1
  tail -12 $OUT/tests.txt
  step "issue 63: batch 1"
  timeout 150 python bench/latency.py --shapes llama-3.1-8b gemma-3-12b qwen3-30b-a3b --no-baseline \
    --variants overlap 2>&1 | tail -5
  step "issue 63: the grouped-expert kernels' tiles"
  timeout 120 python bench/moe_kernels.py --tokens 1 8 64 256 2>&1 | tail -10
  step "issue 63: 256 sequences of Qwen3-30B-A3B"
  timeout 100 python $T --shape qwen3-30b-a3b 2>&1 | tail -3
fi
if [ "$mode" = moe-decode ]; then
  step "issue 63: the experts' kernels, tests"
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE tests/test_fused_moe.py tests/test_moe.py \
    "tests/test_row_kernels.py::test_the_cuda_layer_parts_forward_like_the_eager_ones_and_import_no_compiler" \
    > $OUT/tests.txt 2>&1
  tail -6 $OUT/tests.txt
  step "issue 63: the decode GEMVs beside the grouped kernel"
  timeout 150 python bench/moe_kernels.py --tokens 16 64 --gemv-tokens 1 2 4 8 2>&1 | tail -40
  step "issue 63: batch 1"
  timeout 100 python bench/latency.py --shapes qwen3-30b-a3b --no-baseline --variants overlap 2>&1 | tail -2
  step "issue 63: batch 1, the grouped kernel at every batch (the baseline)"
  timeout 100 python -c "import runpy, sys; from nanoinfer.backends.cuda import fused_moe
fused_moe.few_pairs = lambda *a: False
sys.argv = ['bench/latency.py', '--shapes', 'qwen3-30b-a3b', '--no-baseline', '--variants', 'overlap']
runpy.run_path('bench/latency.py', run_name='__main__')" 2>&1 | tail -1
fi
if [ "$mode" = moe-fp8 ]; then
  step "issue 63: batch 1 in fp8"
  timeout 330 python bench/latency.py --shapes llama-3.1-8b qwen3-30b-a3b mixtral-8x7b --no-baseline \
    --variants overlap --quantization fp8 2>&1 | tail -4
  step "issue 63: 256 sequences in fp8, dense 8B beside Mixtral-8x7B"
  for shape in llama-3.1-8b mixtral-8x7b; do
    timeout 130 python $T --shape $shape --quantization fp8 2>&1 | tail -3
  done
fi
if [ "$mode" = moe-all ]; then
  left() { [ $SECONDS -lt ${BUDGET:-480} ] || { echo "(skipped: past ${BUDGET:-480} s)"; return 1; }; }
  step "issue 63: the experts' kernels, tests"
  timeout 150 python -m pytest -q -p no:cacheprovider -rfE tests/test_fused_moe.py tests/test_moe.py \
    "tests/test_row_kernels.py::test_the_cuda_layer_parts_forward_like_the_eager_ones_and_import_no_compiler" \
    > $OUT/tests.txt 2>&1
  tail -6 $OUT/tests.txt
  step "issue 63: batch 1, bf16, then the grouped kernel at every batch (the baseline)"
  left && timeout 50 python bench/latency.py --shapes qwen3-30b-a3b --no-baseline --variants overlap 2>&1 | tail -1
  left && timeout 50 python -c "import runpy, sys; from nanoinfer.backends.cuda import fused_moe
fused_moe.few_pairs = lambda *a: False
sys.argv = ['bench/latency.py', '--shapes', 'qwen3-30b-a3b', '--no-baseline', '--variants', 'overlap']
runpy.run_path('bench/latency.py', run_name='__main__')" 2>&1 | tail -1
  step "issue 63: batch 1 in fp8"
  left && timeout 110 python bench/latency.py --shapes llama-3.1-8b qwen3-30b-a3b mixtral-8x7b --no-baseline \
    --variants overlap --quantization fp8 2>&1 | tail -3
  step "issue 63: 256 sequences in fp8, Mixtral-8x7B beside the dense 8B"
  for shape in mixtral-8x7b llama-3.1-8b; do
    left && timeout 75 python $T --shape $shape --quantization fp8 2>&1 | tail -2
  done
  step "issue 63: the decode GEMVs beside the grouped kernel"
  left && timeout 50 python bench/moe_kernels.py --tokens 64 --gemv-tokens 1 2 4 8 2>&1 | tail -40
fi
if [ "$mode" = fp8-oom ]; then
  step "fp8 at 256 sequences: the weights quantized after a bf16 model"
  timeout 90 python -c "import runpy, sys, bench.shapes as s
made = s.random_model
s.random_model = lambda name, device='cuda', dtype=None, quantization='none': made(name, device)
sys.argv = ['bench/throughput.py'] + '$T'.split()[1:] + ['--shape', 'llama-3.1-8b', '--quantization', 'fp8']
runpy.run_path('bench/throughput.py', run_name='__main__')" 2>&1 | grep -E "OutOfMemory|nanoinfer  " | cut -c1-300
  step "fp8 at 256 sequences, expandable segments"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 90 python $T --shape llama-3.1-8b --quantization fp8 2>&1 \
    | grep -E "OutOfMemory|nanoinfer  " | cut -c1-300
  step "bf16 at 256 sequences (the control)"
  timeout 80 python $T --shape llama-3.1-8b 2>&1 | grep -E "OutOfMemory|nanoinfer  " | cut -c1-300
  step "issue 63: batch 1, the down GEMV's new tile, then the grouped kernel at every batch"
  timeout 50 python bench/latency.py --shapes qwen3-30b-a3b --no-baseline --variants overlap 2>&1 | tail -1
  timeout 50 python -c "import runpy, sys; from nanoinfer.backends.cuda import fused_moe
fused_moe.few_pairs = lambda *a: False
sys.argv = ['bench/latency.py', '--shapes', 'qwen3-30b-a3b', '--no-baseline', '--variants', 'overlap']
runpy.run_path('bench/latency.py', run_name='__main__')" 2>&1 | tail -1
fi
echo "=== done $(date +%T)"
