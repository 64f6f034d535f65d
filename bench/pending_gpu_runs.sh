#!/usr/bin/env bash
# The device runs owed to issues 63 and 65, one mode per device call (carry .whl: the cp312 wheels of msgspec
# starlette uvicorn gguf llguidance websockets httptools, as the device's README says).
# Modes:
#   verify   (~6 min) the GPU tests of determinism and the experts (tests/test_gpu_determinism.py,
#            tests/test_fused_moe.py, tests/test_moe.py), then the deterministic mode's cost: batch 1 and 256 sequences.
#   families (~8 min) batch-1 decode of the dense 8B beside Gemma-3-12B, Phi-4 and Qwen3-30B-A3B shapes
#            (bench/shapes.py), then 256 sequences offline of the 8B beside Qwen3-30B-A3B.
#   fp8-oom  (~9 min; on wip/capture-stream, which captures every graph on one stream) why 256 sequences of fp8 weights ran out of memory in CUDA-graph capture (thirteenth session:
#            Mixtral-8x7B and the dense 8B alike, the graphs' pool 5.7-6.1 GiB): the 8B in fp8 with the weights
#            quantized after a bf16 model (the path before layer-by-layer quantizing), with expandable segments,
#            and bf16 as the control; then batch 1 of Qwen3-30B-A3B with the down GEMV's new tile, beside the grouped
#            kernel at every batch.
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
if [ "$mode" = fp8-oom ]; then
  step "fp8 at 256 sequences, every capture on one stream (wip/capture-stream), then a stream per capture (main's)"
  timeout 90 python $T --shape llama-3.1-8b --quantization fp8 2>&1 | grep -E "OutOfMemory|nanoinfer  " | cut -c1-300
  timeout 90 python -c "import runpy, sys, torch; from nanoinfer.backends.cuda import graphs
graphs.StepGraphs._capture_stream = lambda self: torch.cuda.Stream(self.device)
sys.argv = ['bench/throughput.py'] + '$T'.split()[1:] + ['--shape', 'llama-3.1-8b', '--quantization', 'fp8']
runpy.run_path('bench/throughput.py', run_name='__main__')" 2>&1 | grep -E "OutOfMemory|nanoinfer  " | cut -c1-300
  step "the CUDA-graph tests on one capture stream"
  timeout 120 python -m pytest -q -p no:cacheprovider -x tests/test_gpu.py -k "graph" 2>&1 | tail -2
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
  grouped_baseline 50 --shapes qwen3-30b-a3b --no-baseline --variants overlap 2>&1 | tail -1
fi
echo "=== done $(date +%T)"
