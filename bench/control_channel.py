"""Per-order cost of the control channel (shared memory) beside a gloo broadcast of the same header.

    python bench/control_channel.py [--ranks 2] [--messages 2000] [--gap-ms 2] [--spin-ms 0.1 50]

Rank 0 sends a forward's header (tensor_parallel.HEADER int64s, the send time among them) to the
other ranks, one every `gap` (a step's host work, during which the ranks wait for the next
order), over the control channel and over a gloo group's broadcast. Per transport, two
figures, medians and 99th percentiles: rank 0's time in the call (what its step pays), and
the latency from the call's start to the message in the reader's hands (what the rank's step
start waits; perf_counter is the system's monotonic clock, one for every process). The
channel's readers are timed at each spin (seconds they poll before sleeping: the CPU ranks'
0.1 ms, the GPU ranks' 50 ms). Prints one table.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_rank(rank: int, size: int, init: str, args, ring, results) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from runtime.executor.control_channel import ChannelReader, ChannelWriter
    from runtime.executor.tp_groups import SLOT_SIZE, SLOTS
    from runtime.executor.tp_orders import HEADER

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    header = torch.zeros(HEADER, dtype=torch.int64)
    rows = []
    for transport, spin in [("gloo", None), *(("channel", s / 1e3) for s in args.spin_ms)]:
        if transport == "channel":  # (the writer first: it writes the layout that the readers check)
            channel = ChannelWriter(ring.numpy(), SLOTS, SLOT_SIZE, size - 1) if rank == 0 else None
            dist.barrier()
            channel = channel or ChannelReader(ring.numpy(), rank - 1, spin=spin)
        dist.barrier()
        took = []
        for _ in range(args.messages):
            if rank == 0:
                end = time.perf_counter() + args.gap_ms / 1e3
                while time.perf_counter() < end:  # (the step's host work: busy, as rank 0 is)
                    pass
                begun = time.perf_counter_ns()
                header[1] = begun
                if transport == "gloo":
                    dist.broadcast(header, src=0)
                else:
                    channel.write(header.numpy())
                took.append(time.perf_counter_ns() - begun)
            elif transport == "gloo":
                dist.broadcast(header, src=0)
                took.append(time.perf_counter_ns() - int(header[1]))
            else:
                message = channel.read()
                took.append(time.perf_counter_ns() - int(np.frombuffer(message, np.int64)[1]))
        if transport == "channel":
            del channel
        rows.append((transport, spin, took[args.messages // 10:]))  # (the first tenth: warm-up)
    results.put((rank, rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="rank 0 and ranks-1 readers (default: TP=2 or PP=2's)")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="rank 0's busy time between two orders")
    parser.add_argument("--spin-ms", type=float, nargs="+", default=[0.1, 50.0])
    args = parser.parse_args()

    import os
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from runtime.executor.control_channel import channel_bytes
    from runtime.executor.tp_groups import SLOT_SIZE, SLOTS

    ring = torch.zeros(channel_bytes(SLOTS, SLOT_SIZE, args.ranks - 1), dtype=torch.uint8).share_memory_()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=run_rank, args=(r, args.ranks, os.path.join(tmp, "init"), args, ring, results))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        got = {}
        while len(got) < len(procs):
            try:
                rank, rows = results.get(timeout=1)
                got[rank] = rows
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("a rank failed (its traceback above)") from None
        for p in procs:
            p.join(60)

    def us(ns: list[int], q: float) -> str:
        return f"{statistics.quantiles(ns, n=100)[int(q) - 1] / 1e3:.1f}" if q < 100 else ""

    print(f"{args.ranks} ranks, {args.messages} orders each {args.gap_ms} ms apart, {os.cpu_count()} CPUs; µs:")
    print("| transport | rank 0 in the call, median | p99 | to the reader, median | p99 |")
    print("|---|---|---|---|---|")
    for (transport, spin, sent), *readers in zip(got[0], *(got[r] for r in range(1, args.ranks))):
        received = [t for _, _, took in readers for t in took]
        name = "gloo broadcast" if transport == "gloo" else f"control channel, spin {spin * 1e3:g} ms"
        print(f"| {name} | {statistics.median(sent) / 1e3:.1f} | {us(sent, 99)} | "
              f"{statistics.median(received) / 1e3:.1f} | {us(received, 99)} |")


if __name__ == "__main__":
    main()
