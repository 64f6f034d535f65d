#!/usr/bin/env bash
# The device runs still owed to issues 60 and 65, one script per device call (sessions since the eighth could not
# start a machine). Prepare here, then carry .whl and .scratch:
#   python bench/dummy_checkpoint.py qwen3-0.6b .scratch/qwen06            # (Qwen3-0.6B shape, dummy weights)
#   mkdir -p .scratch/gcthr && git archive HEAD nanoinfer runtime | tar -x -C .scratch/gcthr
#   # then in .scratch/gcthr/runtime/serve/server.py, after the lifespan's gc.freeze(): gc.set_threshold(20000, 10, 10)
#   # and the cp312 wheels (see the device's README): msgspec starlette uvicorn gguf llguidance websockets httptools py-spy
# (llguidance >= 1.9, as pyproject asks: 1.6's LLTokenizer takes one EOS id and the engine process exits.)
# Modes: serve (the 512 streams only), serve-all (and the GC variant and the probe), det (issue 65's tests,
# ~3 min), tiny (det + 512 streams, ~5 min), short (+ throughput with and without
# --deterministic), all (+ the GC-threshold variant and the linear-tile probe, ~10 min).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() { echo "=== $* ($(date +%T))"; }
S="bench/serving.py --model $PWD/.scratch/qwen06 --load-format dummy --device cuda --input-len 100 1024 --output-len 100 1024 --client-processes 4"
A='--engine-process on --log-level warning'
mode=${1:-det}
if [ "$mode" != serve ] && [ "$mode" != serve-all ]; then
  step "issue 65: tests/test_gpu_determinism.py"
  timeout 150 python -m pytest -q -p no:cacheprovider -rA tests/test_gpu_determinism.py > $OUT/det.txt 2>&1
  grep -E "PASS|FAIL|Error|passed|failed" $OUT/det.txt | tail -40
fi
if [ "$mode" != det ]; then
  step "issue 60: 512 x 512, server beside offline (front µs a token, ITL histogram's 30/40/75 ms bounds)"
  timeout 150 python $S --clients 512 --requests 512 --idle-requests 3 --serve-args "$A" 2>&1 | tee $OUT/s512.txt | tail -24
fi
if [ "$mode" = short ] || [ "$mode" = all ]; then
  step "issue 65: the deterministic mode's cost (256 sequences)"
  for det in "" --deterministic; do
    timeout 40 python bench/throughput.py --shape qwen3-0.6b --device cuda --num-seqs 256 --input-len 100 1024 \
      --output-len 100 1024 --no-baseline $det 2>&1 | tail -2
  done
fi
if [ "$mode" = all ] || [ "$mode" = serve-all ]; then
  step "issue 60: 512 x 512 with the front's gen-0 GC threshold at 20,000"
  R=$PWD; (cd .scratch/gcthr && timeout 100 python $R/$S --clients 512 --requests 512 --no-offline --idle-requests 0 \
    --serve-args "$A" 2>&1 | tee $OUT/s512gc.txt | tail -16)
  step "issue 65: which tile parameter changes a quantized row's bits"
  timeout 50 python bench/batch_invariance_probe.py linear_tiles 2>&1 | tee $OUT/probe.txt | tail -25
fi
echo "=== done $(date +%T)"
