"""`nanoinfer generate` streams the completion to stdout; bad flags fail with a clear message."""

import os
import signal
import subprocess
import sys

import pytest

from nanoinfer import LLM, SamplingParams


def run_cli(*args, cache_env=None):
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(cache_env or {})})


@pytest.mark.slow
def test_generate_streams_the_same_text_as_the_api(smollm2_gguf):
    proc = run_cli("generate", "The capital of France is", "--model", str(smollm2_gguf), "--max-tokens", "8",
                   "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(smollm2_gguf, device="cpu", progress=False)
    expected = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert proc.stdout == expected[0].text + "\n"
    assert "loading" in proc.stderr  # the progress bar goes to stderr, never into the text
    assert "default model" not in proc.stderr  # (a model was named)


def test_the_default_model_says_what_it_is_and_how_to_run_another(smollm2_gguf):
    proc = run_cli("generate", "The capital of France is", "--max-tokens", "1", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    note = [line for line in proc.stderr.splitlines() if "default model" in line]
    assert len(note) == 1 and "135M" in note[0] and "--model" in note[0], proc.stderr


@pytest.mark.slow
def test_chat_flag_applies_the_template(smollm2_gguf):
    proc = run_cli("generate", "Say hi", "--chat", "--model", str(smollm2_gguf), "--max-tokens", "6", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(smollm2_gguf, device="cpu", progress=False)
    expected = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=6))
    assert proc.stdout == expected.text + "\n"


@pytest.mark.slow
def test_bad_values_name_themselves(smollm2_gguf, tmp_path):
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--dtype", "float8", "--device", "cpu")
    assert proc.returncode == 2 and "float8" in proc.stderr
    proc = run_cli("generate", "x", "--model", str(tmp_path / "nope.gguf"))
    assert proc.returncode == 2 and "nope.gguf" in proc.stderr
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--top-p", "0", "--device", "cpu")
    assert proc.returncode == 2 and "top_p" in proc.stderr
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--quantization", "int3", "--device", "cpu")
    assert proc.returncode == 2 and "int3" in proc.stderr and "'gguf'" in proc.stderr
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--kv-cache-dtype", "fp16", "--device", "cpu")
    assert proc.returncode == 2 and "fp16" in proc.stderr and "'fp8'" in proc.stderr


def test_serve_prints_its_url_serves_and_stops_gracefully(smollm2_gguf):
    import re
    import signal

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", str(smollm2_gguf), "--port", "0",
                             "--device", "cpu", "--num-blocks", "64", "--shutdown-timeout", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = match.group(0)
        r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        # The model id is the file's stem: the path (where the weights live) is nobody's business.
        assert r.json()["model"] == smollm2_gguf.stem
        assert str(smollm2_gguf.parent) not in httpx.get(url + "/v1/models").text + httpx.get(url + "/").text
        # A stream in flight when SIGTERM arrives, with no time to finish (--shutdown-timeout 0):
        # it ends with an error, not a finish_reason that looks like success (issue 31), and the
        # server still exits cleanly.
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Once", "max_tokens": 300, "stream": True},
                          timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and rest[-3] == "event: error" and '"code":"shutting_down"' in rest[-2]
        assert proc.wait(timeout=60) == 0
        log = proc.stderr.read()
        # One line per request at --log-level info (the default): tokens, finish reason, timings.
        assert re.search(r"cmpl-\w+: 200, prompt \d+ tokens, output 4 tokens, finish length, ttft \d+ ms", log), log
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_chat_keeps_history_stops_on_ctrl_c_and_resets(smollm2_gguf):
    import pexpect

    # (a user at a terminal: Ctrl-C delivered, even where this test runs in the background, whose
    # processes inherit SIGINT ignored and so would ignore it too)
    child = pexpect.spawn(sys.executable, ["-m", "runtime.cli", "chat", "--model", str(smollm2_gguf), "--device",
                                           "cpu", "--temperature", "0", "--max-tokens", "400"],
                          encoding="utf-8", timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect(">>> ")
        child.sendline("What is the capital of France? Answer in one word.")
        child.expect(">>> ")
        first_reply = child.before
        assert "Paris" in first_reply
        child.sendline("Write a very long story about the sea.")
        # (the terminal echoes the line first: words of the echo are not the reply, and a Ctrl-C
        # sent before the reply starts may reach readline rather than the stream)
        child.expect_exact("Write a very long story about the sea.")
        child.expect(r"\w+ \w+")  # the reply has started streaming
        child.sendintr()  # Ctrl-C stops the reply, not the program
        child.expect(r"\[stopped\]")
        child.expect(">>> ")
        child.sendline("/reset")
        child.expect(r"\(conversation cleared\)")
        child.expect(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_async_scheduling_flag_reaches_the_engine_config():
    from runtime.cli import _engine_kwargs, _parser
    from runtime.async_engine import engine_config

    for flag, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = _parser().parse_args(["serve", *flag])
        assert engine_config(**_engine_kwargs(args)).async_scheduling is want


@pytest.mark.slow
def test_version_and_defaults_in_help():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("nanoinfer ")
    for command in ("generate", "serve", "chat"):
        text = run_cli(command, "--help").stdout
        assert "--max-num-seqs MAX_NUM_SEQS" in text and "(default: 256)" in text, command
    assert "(default: 127.0.0.1)" in run_cli("serve", "--help").stdout


@pytest.mark.slow
def test_generate_reads_the_prompt_from_stdin(smollm2_gguf):
    args = ["-m", "runtime.cli", "generate", "-", "--model", str(smollm2_gguf), "--max-tokens", "4", "--device", "cpu"]
    piped = subprocess.run([sys.executable, *args], input="The capital of France is", capture_output=True, text=True,
                           timeout=300)
    direct = run_cli("generate", "The capital of France is", *args[4:])
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout and piped.stdout.strip()


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    from runtime.cli import _engine_kwargs, parse_args
    from runtime.async_engine import engine_config

    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 8\nswap_space: 1GiB\npreemption-mode: swap\nmax-n: 4\n")
    args = parse_args(["serve", "--config", str(config), "--max-num-seqs", "4"])
    engine = engine_config(**_engine_kwargs(args))
    assert engine.scheduler.max_num_seqs == 4  # the command line wins
    assert engine.swap_space == 1 << 30 and engine.scheduler.preemption_mode == "swap" and args.max_n == 4
    (tmp_path / "bad.json").write_text('{"max-num-sequences": 8}')
    proc = run_cli("serve", "--config", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "max-num-sequences" in proc.stderr and "max-num-seqs" in proc.stderr


def test_serve_checks_the_port_before_loading_the_model():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("serve", "--port", str(port), "--model", "/nonexistent/model.gguf")
    assert proc.returncode == 2 and f"port {port}" in proc.stderr and "in use" in proc.stderr


def test_chat_says_when_a_reply_hit_max_tokens(smollm2_gguf):
    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "runtime.cli", "chat", "--model", str(smollm2_gguf), "--device",
                                           "cpu", "--temperature", "0", "--max-tokens", "3"],
                          encoding="utf-8", timeout=120)
    try:
        child.expect(">>> ")
        child.sendline("Write a long poem about the sea.")
        child.expect(r"\[the reply hit --max-tokens 3\]")
        child.expect(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()


@pytest.mark.slow
def test_structured_output_flags(smollm2_gguf, tmp_path):
    """llama.cpp's `--json-schema` (text or @FILE) and the regex/choice flags constrain the
    output; a bad pattern, or two at once, is named."""
    import json
    import re

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    proc = run_cli("generate", "The capital of France, as JSON:", "--chat", "--model", str(smollm2_gguf),
                   "--max-tokens", "30", "--device", "cpu", "--json-schema", f"@{tmp_path / 'schema.json'}")
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)) == {"city"}
    proc = run_cli("generate", "Pick a number:", "--model", str(smollm2_gguf), "--max-tokens", "10", "--device",
                   "cpu", "--regex", "[0-9]{3}")
    assert proc.returncode == 0 and re.fullmatch("[0-9]{3}\n", proc.stdout), proc.stderr
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--device", "cpu", "--regex", "(unclosed")
    assert proc.returncode == 2 and "regex cannot constrain generation" in proc.stderr
    proc = run_cli("generate", "x", "--model", str(smollm2_gguf), "--device", "cpu", "--regex", "a", "--choice", "b")
    assert proc.returncode == 2 and "exactly one of" in proc.stderr


def test_env_says_which_cpu_kernels_run():
    """`nanoinfer env` prints the versions, the CPU's SIMD features and the kernels chosen for it
    (the line the engine logs at start), for bug reports."""
    from nanoinfer.backends.cpu import cpu_native
    from runtime.env_report import cpu_model_and_flags

    proc = run_cli("env")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("nanoinfer ") and any(line.startswith("cpu: ") for line in lines)
    assert f"cpu kernels: {cpu_native.describe(cpu_native.library())}" in lines
    assert cpu_model_and_flags("model name\t: Some CPU\nflags\t\t: fpu avx2 fma avx512f\n") == (
        "Some CPU", ["avx2", "fma", "avx512f"])
    assert cpu_model_and_flags("Features\t: fp asimd asimddp i8mm\n")[1] == ["asimd", "asimddp", "i8mm"]
    proc = run_cli("env", cache_env={"NANOINFER_CPU_ISA": "sse9"})
    assert proc.returncode == 2 and "NANOINFER_CPU_ISA='sse9'" in proc.stderr



def test_chat_help_says_how_to_quit_and_reset():
    text = run_cli("chat", "--help").stdout
    assert "/exit" in text and "/reset" in text and "Ctrl-D" in text


def test_eval_speed_plot_without_matplotlib_fails_before_the_benchmark(monkeypatch, capsys):
    import runtime.cli as cli

    def no_engine(args):
        raise AssertionError("the model was loaded: the missing plotting library was found only after the run")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib raises ImportError)
    monkeypatch.setattr(cli, "_async_engine", no_engine)
    assert cli.main(["eval", "speed", "--plot", "speed.png", "--device", "cpu"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
