"""A tensor-parallel rank that fails where a test asks (tests/test_tp_ranks.py): the real rank
(runtime/executor/tp_rank.py) with one of its steps replaced, chosen by NANOINFER_TEST_RANK_FAILS:

- `start`: raises before the rendezvous; `rendezvous`: exits (code 5) having checked in, inside it;
- `setup`: raises making its KV pool; `step`: raises in its third forward (rank 0 in its collectives);
- `close`: raises leaving the process group at `stop`;
- `idle`: no failure, but its collectives time out after 1 s (an order may take longer to come).

Run as `python -m tests.tp_failing_rank RANK SIZE HOST:PORT`, as runtime/executor/tensor_parallel.py's RANK_MODULE.
"""

import datetime
import os
import sys

import torch.distributed as dist

from runtime.executor import tp_follower, tp_rank


def fail(where: str):
    def failing(*args, **kwargs):
        raise RuntimeError(f"test rank fails at {where}")

    return failing


def main() -> None:
    where = os.environ["NANOINFER_TEST_RANK_FAILS"]
    if where == "start":
        tp_follower._join = fail(where)
    elif where == "rendezvous":
        def exit_inside(*args, **kwargs):
            os._exit(5)

        dist.init_process_group = exit_inside  # (tp_follower._join checked in at rank 0's store first)
    elif where == "setup":
        tp_follower.KVPools = fail(where)
    elif where == "step":
        forward, calls = tp_follower.forward, []

        def failing_third(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("test rank fails at step")
            return forward(*args, **kwargs)

        tp_follower.forward = failing_third
    elif where == "close":
        tp_follower.leave_groups = fail(where)
    elif where == "idle":
        tp_follower.TIMEOUT = datetime.timedelta(seconds=1)
    else:
        raise ValueError(f"NANOINFER_TEST_RANK_FAILS={where!r}: expected start, rendezvous, setup, step, close or idle")
    tp_rank.main(sys.argv[1:])


if __name__ == "__main__":
    main()
