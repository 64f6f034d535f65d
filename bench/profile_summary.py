"""Where a server's host time goes: py-spy's collapsed stacks (`bench/serving.py --profile`) summed by thread and by cost.

    python bench/profile_summary.py PROFILE.txt [--top 25]

Each active sample is charged to one cost: the innermost frame of the stack that a rule below names (the rules
are the server's parts: the step's planning, its inputs, the forward's launch, waiting for the device, turning
tokens into outputs and text, queue hops, messages between processes, SSE/JSON, HTTP, the event loop); a sample
no rule names is "other". Shares are of all active samples of the process; `--top` lists the functions with the
most samples inside them (inclusive) per thread.
"""

from __future__ import annotations

import argparse
import collections
import re

# (cost, pattern over "function (file:line)") — the first cost whose pattern the innermost-matching frame meets
RULES = (
    ("idle: blocked in select, a lock or a queue (the GIL free)",
     r"^(EpollSelector\.select|select|Condition\.wait|Event\.wait|SimpleQueue\.get|Queue\.get|_wait_for_tstate_lock|"
     r"sleep|poll|Connection\._recv|Connection\.poll|recv_into) \("),
    ("wait for the device", r"synchronize|\.item |cudaStreamSynchronize|wait_event|event_wait|DeviceToHost|_wait_for"),
    ("messages (pickle, sockets)", r"engine_process/messages\.py|multiprocessing/connection|pickle|msgspec/msgpack"),
    ("outputs: detokenize", r"detokenizer\.py|tokenizer\.py|tokenizers"),
    ("outputs: take, stop strings", r"request_state\.py|outputs\.py|resolve\.py"),
    ("step: plan", r"scheduler\.py|policy\.py|block_manager\.py|prefix_cache\.py|sequence\.py|virtual_engines"),
    ("step: inputs", r"input_batch\.py|model_runner\.py|batch\.py|host_copy\.py|kv_pools|step\.py"),
    ("step: forward and sampling launch", r"nanoinfer/|triton|torch/"),
    ("queue hops (worker, books)", r"worker\.py|request_book\.py|loop_inbox\.py|engine_process/(client|replica)\.py|queue\.py|threading\.py"),
    ("SSE and JSON", r"renderers\.py|responses\.py|json|api_mapping\.py|admission\.py|protocol\.py"),
    ("HTTP (uvicorn, h11, starlette)", r"uvicorn|h11|starlette|httptools"),
    ("event loop", r"asyncio|uvloop|selectors"),
)


def cost_of(frames: list[str]) -> str:
    for depth, frame in enumerate(reversed(frames)):  # innermost first
        for cost, pattern in RULES if depth == 0 else RULES[1:]:  # (idle: only where the sample is)
            if re.search(pattern, frame):
                return cost
    return "other"


def read(path: str):
    """(thread, frames, count) per line of py-spy's raw format: "thread;frame;...;frame count"."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            parts = stack.split(";")
            # py-spy --threads puts "process PID:\"cmd\"" then "thread (0x..)" first; keep the thread's name
            process = next((p.split(":", 1)[0] for p in parts if p.startswith("process ")), "")
            thread = next((p for p in parts if p.startswith("thread ")), "thread ?")
            frames = [p for p in parts if not p.startswith(("process ", "thread "))]
            yield f"{process} {thread}".strip(), frames, int(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    by_thread, by_cost = collections.Counter(), collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, frames, count in read(args.profile):
        by_thread[thread] += count
        by_cost[cost_of(frames)] += count
        for frame in set(frames):
            inclusive[thread][frame] += count
        if frames:
            own[thread][frames[-1]] += count
    total = sum(by_thread.values()) or 1
    print(f"{total} active samples")
    print("\nby thread:")
    for thread, n in by_thread.most_common():
        print(f"  {n / total:6.1%}  {thread}")
    print("\nby cost:")
    for cost, n in by_cost.most_common():
        print(f"  {n / total:6.1%}  {cost}")
    for thread, n in by_thread.most_common(4):
        print(f"\ninside {thread} ({n / total:.1%}; frames under every sample of it left out):")
        for frame, m in [(f, m) for f, m in inclusive[thread].most_common() if m < n][:args.top]:
            print(f"  {m / total:6.1%}  {frame[:150]}")
        print(f"  innermost frames of {thread}:")
        for frame, m in own[thread].most_common(args.top // 2):
            print(f"  {m / total:6.1%}  {frame[:150]}")


if __name__ == "__main__":
    main()
