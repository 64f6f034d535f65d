"""Two steps in flight (runtime/engine/virtual_engines.py): the running sequences in two groups
whose steps alternate change no output.

The engine and scheduler logic is device-independent, so one CPU rank runs it when its runner
says it keeps two steps in flight: every request kind of tests/test_async_scheduling.py comes
out token for token as in the synchronous loop, through chunked prefill, preemption, aborts
and a single request (the fallback: one group has nothing to run); no step holds a sequence
of the step launched just before it unless its own group had nothing to run; between steps
no sequence has more than one unread step. Pipeline stages over processes with two steps in
flight are in tests/test_pipeline_parallel.py; grammars, whose masks need the step before read
during the launch, come out as in the synchronous loop too.
"""

import pytest

from nanoinfer import SamplingParams
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineCore
from runtime.executor.model_runner import ModelRunner
from tests.test_async_scheduling import CASES, MODEL, assert_same, run


@pytest.fixture
def two_in_flight(monkeypatch):
    """One rank's runner keeps two steps in flight; each launch is recorded with whether the
    scheduler fell back to the group of the step before (`serial`), and the engine's state
    between steps is checked."""
    launches = []
    launch, step = ModelRunner.launch, EngineCore.step

    def recording(self, inp, *args, **kwargs):
        lanes = self.engine_scheduler.lanes
        launches.append(({c.seq.seq_id for c in inp.chunks}, lanes is not None and lanes.serial))
        return launch(self, inp, *args, **kwargs)

    def checked(core):
        core.executor.engine_scheduler = core.scheduler
        outputs = step(core)
        assert len(core._in_flight) <= 2
        assert all(s.num_unresolved <= 1 for seqs in core.scheduler.requests.values() for s in seqs)
        return outputs

    monkeypatch.setattr(ModelRunner, "steps_in_flight", 2)
    monkeypatch.setattr(ModelRunner, "launch", recording)
    monkeypatch.setattr(EngineCore, "step", checked)
    return launches


def assert_alternating(launches):
    """No launched step shares a sequence with the one before it, but where it fell back."""
    overlapping = [i for i in range(1, len(launches)) if launches[i][0] & launches[i - 1][0]]
    assert all(launches[i][1] for i in overlapping)
    assert len(overlapping) < len(launches) / 2, "most steps overlap the one before"


def test_the_default_engine_keeps_one_step_in_flight():
    core = EngineCore(MODEL, engine_config(block_size=4, num_blocks=64))
    assert core.executor.steps_in_flight == 1 and core.steps_in_flight == 0  # (the CPU: synchronous)
    assert core.scheduler.lanes is None
    core = EngineCore(MODEL, engine_config(block_size=4, num_blocks=64, async_scheduling=True))
    assert core.steps_in_flight == 1 and core.scheduler.lanes is None


@CASES
def test_two_steps_in_flight_equal_sync(two_in_flight, engine_args):
    sync, _ = run(False, **engine_args)
    two_in_flight.clear()
    overlapped, core = run(True, **engine_args)
    assert core.steps_in_flight == 2 and core.scheduler.lanes is not None
    assert_same(overlapped, sync)
    assert_alternating(two_in_flight)
    assert core.scheduler.lanes.load == [0, 0]
    if engine_args["num_blocks"] == 40:
        assert core.scheduler.num_preemptions > 0


def test_aborts_while_two_steps_are_in_flight(two_in_flight):
    sync, _ = run(False, abort_after=3, num_blocks=512)
    overlapped, _ = run(True, abort_after=3, num_blocks=512)
    aborted = [k for k in sync if k[0] % 4 == 1]
    assert sum(sync[k][1] == overlapped[k][1] == "abort" for k in aborted) >= 4
    for k in aborted:  # (an abort lands up to two steps later in what the caller has seen)
        shown = min(len(sync[k][0]), len(overlapped[k][0]))
        assert overlapped[k][0][:shown] == sync[k][0][:shown]
    assert_same({k: v for k, v in overlapped.items() if k not in aborted},
                {k: v for k, v in sync.items() if k not in aborted})


def test_a_single_request_falls_back_to_one_group(two_in_flight):
    """One sequence: its group runs every step (serial), reading the step before first."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = []
    for async_scheduling in (False, True):
        two_in_flight.clear()
        core = EngineCore(MODEL, engine_config(block_size=4, num_blocks=64, async_scheduling=async_scheduling))
        seq = core.add_request([1, 2, 3], params)
        while core.has_unfinished():
            core.step()
        tokens.append(seq.output_token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    assert all(serial for _, serial in two_in_flight[1:])


def test_grammars_with_two_steps_in_flight(two_in_flight, tiny_chat_model):
    """Constrained sequences (each step's masks need the grammar to have consumed its sequences'
    tokens of the step before: read during the launch) and free ones, n = 3, chunked prefills:
    the same tokens as the synchronous loop."""
    from tests.test_structured_output import PERSON, prompts
    from tests.test_structured_output import run as run_constrained

    ps = prompts(tiny_chat_model, 6, seed=2)
    reqs = [(p, SamplingParams(temperature=0.9, seed=i, n=3 if i % 2 else 1, max_tokens=40,
                               structured_outputs={"json": PERSON} if i % 3 else None)) for i, p in enumerate(ps)]
    base = run_constrained(tiny_chat_model, reqs)
    two_in_flight.clear()
    assert run_constrained(tiny_chat_model, reqs, async_scheduling=True, max_num_batched_tokens=24) == base
    assert_alternating(two_in_flight)
