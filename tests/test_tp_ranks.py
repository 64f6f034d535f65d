"""The ranks the engine starts on its host (runtime/executor/tp_processes.py, tp_rank.py): they
run our module, not the user's program (a script without a main guard, a script on stdin),
and a rank that dies at start, inside the rendezvous, at setup, mid-step or at close is
reported within 10 s naming the rank, its exit code and its traceback's tail; the engine's
close returns within 10 s, and no rank process is left. Two CPU ranks over gloo."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoinfer.sampling.sampler import SamplingParams
from tests.test_tensor_parallel import running, tiny_split_model

ROOT = Path(__file__).parent.parent
BOUND = 10.0  # seconds: the bound for a report and for close (a generous one)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

def user_script(model_import: str, config: str, prompts: list[list[int]], max_tokens: int) -> str:
    """A user's program with no `if __name__ == "__main__"` (a rank that ran it again would
    start ranks of its own): an engine over `model()` (from `model_import`) with `config`,
    greedy tokens of `prompts` and the ranks' pids printed as JSON."""
    return f"""
import json
from nanoinfer.sampling.sampler import SamplingParams
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineCore
{model_import}

core = EngineCore(model(), engine_config({config}))
for prompt in {prompts!r}:
    core.add_request(prompt, SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True))
tokens = {{}}
while core.has_unfinished():
    for out in core.step():
        tokens.setdefault(out.seq.seq_id, []).append(out.token_id)
pids = [p.pid for p in core.executor.tp.procs]
core.close()
print(json.dumps({{"tokens": [tokens[k] for k in sorted(tokens)], "ranks": pids}}))
"""


SCRIPT = user_script("from tests.test_tensor_parallel import tiny_split_model as model",
                     "num_blocks=16, block_size=4, tensor_parallel_size=2", PROMPTS, GREEDY.max_tokens)


def run_user_script(script: str, how: str, tmp_path: Path) -> dict:
    """`script` run as `python script.py` (how="script") or fed to `python -` ("stdin"): its JSON."""
    if how == "script":
        (tmp_path / "run.py").write_text(script)
        args, stdin = [str(tmp_path / "run.py")], None
    else:
        args, stdin = ["-"], script
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # (the script imports the tests' model)
    done = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def greedy(core, prompts: list[list[int]] = PROMPTS, params: SamplingParams = GREEDY) -> list[list[int]]:
    """The prompts' greedy tokens from `core`, in the order they were added."""
    for prompt in prompts:
        core.add_request(prompt, params)
    tokens: dict[int, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.seq.seq_id, []).append(out.token_id)
    return [tokens[k] for k in sorted(tokens)]


def engine(size: int, **config):
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    return EngineCore(tiny_split_model(), engine_config(num_blocks=16, block_size=4, tensor_parallel_size=size,
                                                        **config))


@pytest.fixture(scope="module")
def one_rank():
    core = engine(1)
    try:
        return greedy(core)
    finally:
        core.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["script", "stdin"])
def test_ranks_do_not_run_the_users_program(tmp_path, how, one_rank):
    """A script without a main guard, run as `python script.py` or fed to `python -`: two ranks
    give one rank's greedy tokens, and the ranks are gone when it exits."""
    result = run_user_script(SCRIPT, how, tmp_path)
    assert result["tokens"] == one_rank
    assert len(result["ranks"]) == 1 and not any(running(pid) for pid in result["ranks"])


@pytest.fixture
def failing_rank(monkeypatch):
    """Ranks of tests/tp_failing_rank.py, failing where the test says; the RankProcesses made are kept."""
    from runtime.executor import tensor_parallel

    started = []

    class Recorded(tensor_parallel.RankProcesses):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(tensor_parallel, "RANK_MODULE", "tests.tp_failing_rank")
    monkeypatch.setattr(tensor_parallel, "RankProcesses", Recorded)

    def fails(where: str) -> list:
        monkeypatch.setenv("NANOINFER_TEST_RANK_FAILS", where)
        return started

    return fails


def assert_gone(started) -> None:
    (launch,) = started
    assert [p.poll() is not None for p in launch.procs] == [True]
    assert not any(running(p.pid) for p in launch.procs)


@pytest.mark.parametrize("where, code, tail", [
    ("start", 1, "RuntimeError: test rank fails at start"),
    ("rendezvous", 5, "it wrote nothing"),  # (it checked in, then left without a word: rank 0 inside the rendezvous)
    ("setup", 1, "RuntimeError: test rank fails at setup"),
])
@pytest.mark.slow
def test_a_rank_that_dies_starting_fails_the_start(failing_rank, where, code, tail):
    from runtime.executor.tp_processes import RankLost

    started = failing_rank(where)
    begun = time.monotonic()
    with pytest.raises(RankLost) as lost:
        engine(2)
    assert time.monotonic() - begun < BOUND
    message = str(lost.value)
    assert message.startswith("tensor-parallel rank 1 exited")
    assert f"(code {code})" in message and tail in message
    if code == 1:  # (its traceback's tail: where it failed)
        assert "Traceback" in message or "File " in message
    assert_gone(started)


def test_a_rank_killed_between_steps_fails_the_next(failing_rank):
    """SIGKILL between two generates: the next fails the engine naming the rank and the signal."""
    from runtime.engine.faults import EngineDead

    started = failing_rank("idle")  # (fails nothing here; its collectives' 1 s timeout is the idle test's)
    core = engine(2)
    try:
        greedy(core)
        rank1 = core.executor.tp.procs[0]
        rank1.send_signal(signal.SIGKILL)
        rank1.wait(BOUND)
        begun = time.monotonic()
        with pytest.raises(EngineDead, match=r"tensor-parallel rank 1 exited \(code -9, SIGKILL\)"):
            greedy(core)
        assert time.monotonic() - begun < BOUND
    finally:
        begun = time.monotonic()
        core.close()
        assert time.monotonic() - begun < BOUND
    assert_gone(started)


def test_a_rank_that_fails_mid_step_fails_the_step(failing_rank):
    """Rank 1 raises in its third forward while rank 0 is in the step's collectives: rank 0's
    step fails at once, as that rank's loss, with its traceback's tail."""
    from runtime.engine.faults import EngineDead

    started = failing_rank("step")
    core = engine(2)
    try:
        begun = time.monotonic()
        with pytest.raises(EngineDead) as dead:
            greedy(core)
        assert time.monotonic() - begun < BOUND + 5  # (two steps' work, then the report)
        message = str(dead.value)
        assert "tensor-parallel rank 1 exited (code 1)" in message
        assert "RuntimeError: test rank fails at step" in message
    finally:
        begun = time.monotonic()
        core.close()
        assert time.monotonic() - begun < BOUND
    assert_gone(started)


def test_a_rank_that_fails_at_close_is_reported_and_close_returns(failing_rank, caplog, one_rank):
    started = failing_rank("close")
    core = engine(2)
    assert greedy(core) == one_rank
    begun = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="nanoinfer.tensor_parallel"):
        core.close()
    assert time.monotonic() - begun < BOUND
    (report,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert report.startswith("tensor-parallel rank 1 exited before the engine closed (code 1)")
    assert "RuntimeError: test rank fails at close" in report
    assert_gone(started)


@pytest.mark.slow
def test_a_rank_waits_for_orders_longer_than_a_collectives_timeout(failing_rank, one_rank):
    """An engine idle for longer than its ranks' collective timeout (10 min; 1 s here) keeps
    them: a rank waits for rank 0's next order without a timeout of its own."""
    failing_rank("idle")
    core = engine(2)
    try:
        assert greedy(core) == one_rank
        time.sleep(2)
        assert greedy(core) == one_rank
    finally:
        core.close()


@pytest.mark.slow
def test_a_rank_that_hangs_at_close_is_killed(failing_rank):
    """A rank that does not leave when told (here: stopped by SIGSTOP) is killed: close returns
    within 10 s and nothing is left."""
    started = failing_rank("idle")
    core = engine(2)
    greedy(core)
    os.kill(core.executor.tp.procs[0].pid, signal.SIGSTOP)
    begun = time.monotonic()
    core.close()
    assert time.monotonic() - begun < BOUND
    assert_gone(started)


@pytest.mark.slow
@pytest.mark.parametrize("grid", [dict(size=2), dict(size=1, pipeline_parallel_size=2)], ids=["tp", "pp"])
def test_rank_0_failing_mid_forward_ends_the_engine(grid):
    """Rank 0 runs out of memory in the middle of a forward that the other ranks run with it
    (on a GPU, a large step's activations): they wait in a collective (or for a stage's
    activations) that rank 0 will not make. The engine used to contain it as one GPU does
    (retrying the step in smaller parts), and its next step then waited forever, for
    collectives out of step; now it ends at once (EngineDead naming the failure), and close
    returns."""
    import threading

    import torch

    from runtime.engine.faults import EngineDead

    core = engine(**grid)
    runner = core.executor
    fns = runner.kernels.layer_fns
    calls = []

    def out_of_memory_in_step_3(x, attn, lp, cfg, linear, reduce):
        calls.append(1)
        if len(calls) == 2 * runner.cfg.num_layers + 2:  # (in the second or third step)
            raise torch.OutOfMemoryError("test: out of memory mid-forward")
        return fns.attention_output_and_mlp(x, attn, lp, cfg, linear, reduce)

    runner.kernels = runner.kernels._replace(layer_fns=fns._replace(attention_output_and_mlp=out_of_memory_in_step_3))
    raised = []

    def run():
        try:
            greedy(core)
        except Exception as exc:  # noqa: BLE001 - (what the step raised: asserted below)
            raised.append(exc)

    try:
        steps = threading.Thread(target=run, daemon=True)
        steps.start()
        steps.join(6 * BOUND)  # (generous: the hang it was is the collectives' timeout, 10 minutes)
        assert not steps.is_alive(), "the engine waited on the other rank after rank 0's failure"
        (dead,) = raised
        assert isinstance(dead, EngineDead)
        assert "out of memory mid-forward" in str(dead)
    finally:
        begun = time.monotonic()
        core.close()
        assert time.monotonic() - begun < BOUND
