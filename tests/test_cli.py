"""`nanoinfer generate` streams the completion to stdout; bad flags fail with a clear message."""

import os
import subprocess
import sys

from nanoinfer import LLM, SamplingParams


def run_cli(*args, cache_env=None):
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(cache_env or {})})


def test_generate_streams_the_same_text_as_the_api(smollm2_gguf):
    proc = run_cli("generate", "The capital of France is", "--model", str(smollm2_gguf), "--max-tokens", "8",
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(smollm2_gguf, device="cpu", progress=False)
    expected = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert proc.stdout == expected[0].text + "\n"
    assert "loading" in proc.stderr  # the progress bar goes to stderr, never into the text


def test_chat_flag_applies_the_template(smollm2_gguf):
    proc = run_cli("generate", "Say hi", "--chat", "--model", str(smollm2_gguf), "--max-tokens", "6", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(smollm2_gguf, device="cpu", progress=False)
    expected = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=6))
    assert proc.stdout == expected.text + "\n"


def test_bad_values_name_themselves(smollm2_gguf, tmp_path):
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--dtype", "float8", "--device", "cpu")
    assert proc.returncode == 2 and "float8" in proc.stderr
    proc = run_cli("generate", "x", "--model", str(tmp_path / "nope.gguf"))
    assert proc.returncode == 2 and "nope.gguf" in proc.stderr
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--top-p", "0", "--device", "cpu")
    assert proc.returncode == 2 and "top_p" in proc.stderr
