"""A default request imports no feature it does not use (issue 32: every feature behind a seam).

In a fresh interpreter, the functional core's part of one default request: the default model
loaded (a GGUF), one forward with the CPU's kernels, one greedy sample. Other formats' loaders
and other families' forwards, penalties, structured output, speculative decoding, tensor
parallelism and the GPU's kernels stay unimported, and so do the torch attention backends and
RoPE ops where the packed C layers run instead. (runtime/ is measured by tools/reader_path.py.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ONE_STEP = """
import json, sys
import torch
from nanoinfer import SamplingParams
from nanoinfer.backends.cpu import cpu_native
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.backends.choose import forward_of, kernels_for
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders import load_model
from nanoinfer.sampling.sampler import SamplingTensors, sample

model = load_model(sys.argv[1], device="cpu", progress=False)
cfg, params = model.config, model.params
kernels = kernels_for(cfg, torch.device("cpu"), 16, params=params)
ids = model.tokenizer.encode("The capital of France is")
batch = build_batch([SeqChunk(ids, 0, [0], True)], 16)
logits = forward_of(cfg)(params, allocate_kv_pool(cfg, 1, 16, params.dtype, "cpu"), batch, cfg, kernels.attention,
                         kernels.layer_fns)
st = SamplingTensors.build([SamplingParams(max_tokens=8, temperature=0)], [0], cfg.vocab_size, "cpu")
token = sample(logits, st, kernels.draw)
print(json.dumps({"text": model.tokenizer.decode([int(token[0])]), "native": cpu_native.library() is not None,
                  "modules": sorted(m for m in sys.modules if m.startswith("nanoinfer"))}))
"""

UNUSED = ("nanoinfer.model.nanochat", "nanoinfer.text.nanochat_tokenizer", "nanoinfer.loaders.nanochat_checkpoint", "nanoinfer.loaders.hf",
          "nanoinfer.loaders.hf_hub", "nanoinfer.loaders.llama2c", "nanoinfer.loaders.dummy",
          "nanoinfer.loaders.quantize", "nanoinfer.sampling.penalties", "nanoinfer.structured.grammars",
          "nanoinfer.structured.spec", "nanoinfer.structured.bitmasks", "nanoinfer.structured.lark_check",
          "nanoinfer.sampling.rejection", "nanoinfer.sampling.ngram", "nanoinfer.parallel.shards", "nanoinfer.backends.cuda.graphs",
          "nanoinfer.backends.cuda.gemv", "nanoinfer.backends.cuda.gemv_epilogues", "nanoinfer.backends.cuda.int4_gemv",
          "nanoinfer.backends.cuda.linear", "nanoinfer.backends.cuda.rope_write", "nanoinfer.backends.cuda.argmax", "nanoinfer.backends.cuda.draw_triton",
          # The chat template (and jinja2) load at the first chat request, an HF directory's tokenizer files'
          # readers with such a load.
          "nanoinfer.text.chat_template", "nanoinfer.text.tokenizer_hf",
          # A sampled row's distribution and draw load with the first step that samples: this one is greedy.
          "nanoinfer.sampling.draw",
          # A dense model runs none of the mixture-of-experts layer or its loaders.
          "nanoinfer.model.moe", "nanoinfer.loaders.hf_moe", "nanoinfer.loaders.gguf_moe")
# What the packed CPU path replaces (it runs them where no C compiler built cpu_native).
REPLACED_BY_NATIVE = ("nanoinfer.attention", "nanoinfer.attention.reference", "nanoinfer.attention.torch_paged",
                      "nanoinfer.backends.cpu.rope_write_cpu")


@pytest.mark.slow
def test_a_default_step_imports_no_feature_it_does_not_use(smollm2_gguf):
    done = subprocess.run([sys.executable, "-c", ONE_STEP, str(smollm2_gguf)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # (-c imports from the working directory: this tree's code)
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout.splitlines()[-1])
    assert step["text"] == " Paris"
    unused = UNUSED + (REPLACED_BY_NATIVE if step["native"] else ())
    assert sorted(set(step["modules"]) & set(unused)) == []


WHOLE_REQUEST = """
import json, sys
from nanoinfer import LLM, SamplingParams

llm = LLM(sys.argv[1], device="cpu", progress=False)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
print(json.dumps({"text": out[0].outputs[0].text,
                  "modules": sorted(m for m in sys.modules if m.startswith(("nanoinfer", "runtime")))}))
"""

# The engine's features: their code plugs in at the step's seams and is imported by the
# request (or the failure) that needs it.
UNUSED_IN_RUNTIME = ("runtime.engine.speculative", "runtime.engine.structured_output", "runtime.engine.faults",
                     "runtime.executor.draft_runner", "runtime.executor.verify", "runtime.executor.grammar_masks",
                     "runtime.executor.tensor_parallel", "runtime.executor.tp_grid", "runtime.executor.tp_orders",
                     "runtime.executor.tp_groups", "runtime.executor.tp_follower", "runtime.executor.tp_processes",
                     "runtime.executor.pipeline_parallel", "runtime.executor.pp_stages",
                     "runtime.executor.control_channel", "runtime.serve", "runtime.async_engine", "runtime.worker",
                     "runtime.engine_process.data_parallel", "runtime.engine_process.router",
                     "runtime.engine_process.client", "runtime.engine_process.messages", "runtime.engine_process.replica")


@pytest.mark.slow
def test_a_default_request_runs_no_engine_feature_it_does_not_use(smollm2_gguf):
    done = subprocess.run([sys.executable, "-c", WHOLE_REQUEST, str(smollm2_gguf)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    request = json.loads(done.stdout.splitlines()[-1])
    assert request["text"].startswith(" Paris")
    assert sorted(set(request["modules"]) & set(UNUSED + UNUSED_IN_RUNTIME)) == []
