"""Two "nodes" on one machine: the model's ranks started by two launchers on localhost (gloo, CPU
ranks), as two machines would start them: torchrun's own command line, and nanoinfer's
`--nnodes/--node-rank/--master-addr/--master-port`. Rank 0 runs the engine (and serves HTTP);
the other node's rank follows its steps. The text is one process's."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_flags(gguf) -> list[str]:
    return ["--model", str(gguf), "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def one_process_text(smollm2_gguf) -> str:
    run = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", PROMPT, *_model_flags(smollm2_gguf),
                          "--max-tokens", "12", "--temperature", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()
    return run.stdout


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.mark.slow
def test_nanoinfer_starts_each_nodes_ranks_itself(smollm2_gguf, one_process_text):
    """`nanoinfer generate ... --tensor-parallel-size 2 --nnodes 2 --node-rank R --master-addr A
    --master-port P` on two "machines": node 0 prints the text, node 1 follows and exits."""
    port = _free_port()
    flags = ["generate", PROMPT, *_model_flags(smollm2_gguf), "--max-tokens", "12", "--temperature", "0",
             "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [subprocess.Popen([sys.executable, "-m", "runtime.cli", *flags, "--node-rank", str(rank)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    try:
        (out1, err1), (out0, err0) = (p.communicate(timeout=300) for p in nodes)
    finally:
        _stop(*nodes)
    assert [p.returncode for p in nodes] == [0, 0], (err0[-2000:], err1[-2000:])
    assert out0 == one_process_text and out1 == ""


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_torchrun_serves_over_two_nodes(smollm2_gguf, one_process_text, parallel):
    """torchrun's command line, as the README writes it for two machines, with `serve`: node 0's
    rank 0 answers HTTP with the text of one process; both launchers end when the server does.
    The two ranks hold a shard each (tensor parallelism) or a stage each (pipeline)."""
    http, master = _free_port(), _free_port()
    flags = ["-m", "runtime.cli", "serve", *_model_flags(smollm2_gguf), "--port", str(http),
             parallel, "2", "--log-level", "warning"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master),
                               *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (1, 0)]
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 240
        while True:
            assert all(p.poll() is None for p in nodes), "a launcher exited before the server answered"
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer in 240 s"
                time.sleep(1)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as reply:
            model = json.load(reply)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            text = json.load(reply)["choices"][0]["text"]
        assert text == one_process_text.rstrip("\n")
        nodes[1].send_signal(2)  # SIGINT to node 0's launcher: torchrun passes it on, the server stops
        for p in nodes:
            p.wait(timeout=60)
    finally:
        _stop(*nodes)


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "--node-rank", "2"], "node_rank=2 with nnodes=2: expected a node rank from 0 to 1"),
    (["--nnodes", "2", "--tensor-parallel-size", "3"], "3 ranks over nnodes=2"),
    (["--nnodes", "2", "--pipeline-parallel-size", "3"], "3 ranks over nnodes=2"),  # (T x P ranks in all)
    (["--nnodes", "0"], "nnodes"),
])
def test_a_launch_that_cannot_be_laid_out_is_named(flags, message, capsys):
    """Before anything starts: exit 2 and the values that don't fit."""
    from runtime.cli import main

    assert main(["generate", "hi", "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err
