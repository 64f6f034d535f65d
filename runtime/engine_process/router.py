"""ReplicaRouter: which data-parallel replica takes a request — the one holding the longest cached prefix of its
prompt, else the least loaded.

A replica's prefix cache (runtime/engine/prefix_cache.py) lives on its worker thread, where every step changes
it. Rather than read it across threads (a lock on the step's hot path, or a racy read), the router keeps its own
record of what it sent each replica: the chained keys of each prompt's whole KV blocks (the prefix cache's own
`block_key`, so a record's key is the key the replica registers), an LRU bounded by the replica's KV pool (the
cache cannot hold more blocks than the pool has). The record is an approximation: a block the replica evicted
since (pool pressure), or one of a request aborted before its prefill, still counts as cached here; a prompt's
generated tokens, which the replica caches too, do not. A wrong guess costs only a recomputed prefix: the
replica's own cache decides what it reuses.

The rule, with one guard: among the healthy replicas whose unfinished requests are within `slack` of the least
loaded's, the one with the longest recorded prefix (in whole blocks); ties and no prefix at all go to the least
loaded (fewest unfinished requests, then fewest prompt tokens in flight), then the lowest index. Without the
guard a prefix every request shares (a chat template's default system prompt fills a block) would send all the
traffic to the replica that saw it first; with it that replica takes `slack` more requests at most before the
next one goes elsewhere, records the prefix there too, and from then on the tie goes by load.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence

from runtime.engine.prefix_cache import block_key


class Load(NamedTuple):
    """A replica's queued work, as the router compares it (fewer is better, in this order)."""

    requests: int  # unfinished requests (waiting, running or swapped)
    prompt_tokens: int  # their prompts' tokens


class ReplicaRouter:
    def __init__(self, capacities: Sequence[int], block_size: int, prefix_caching: bool = True, slack: int = 4):
        """`capacities`: each replica's KV pool in blocks (its record's bound); `prefix_caching`
        false: load alone decides (the replicas cache nothing)."""
        if len(capacities) < 1 or min(capacities) < 1:
            raise ValueError(f"capacities={list(capacities)}: expected a positive block count per replica")
        self.block_size, self.prefix_caching, self.slack = block_size, prefix_caching, slack
        self.capacities = tuple(capacities)
        self._sent: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in capacities]

    @property
    def num_replicas(self) -> int:
        return len(self._sent)

    def keys(self, prompt_ids: Sequence[int]) -> list[bytes]:
        """The prefix cache's keys of the prompt's whole blocks."""
        keys: list[bytes] = []
        if not self.prefix_caching:
            return keys
        bs = self.block_size
        for i in range(len(prompt_ids) // bs):
            keys.append(block_key(keys[-1] if keys else b"", prompt_ids[i * bs:(i + 1) * bs]))
        return keys

    def cached_blocks(self, replica: int, keys: Sequence[bytes]) -> int:
        """How many of `keys`' leading blocks the record says `replica` holds."""
        sent, count = self._sent[replica], 0
        for key in keys:  # (chained keys: a block's key stands for its whole prefix)
            if key not in sent:
                break
            count += 1
        return count

    def pick(self, keys: Sequence[bytes], loads: Sequence[Load], healthy: Sequence[bool]) -> int:
        """The replica for a prompt of block `keys` (see the module docstring); ValueError when
        none is healthy."""
        alive = [i for i in range(self.num_replicas) if healthy[i]]
        if not alive:
            raise ValueError("no replica is healthy")
        least = min(loads[i].requests for i in alive)
        near = [i for i in alive if loads[i].requests <= least + self.slack]
        return min(near, key=lambda i: (-self.cached_blocks(i, keys), loads[i], i))

    def record(self, replica: int, keys: Sequence[bytes]) -> None:
        """`replica` took a prompt of block `keys`: it holds (or soon will) those blocks."""
        sent, bound = self._sent[replica], self.capacities[replica]
        for key in reversed(keys):  # (a prompt's first block the most recent: the LRU drops deeper blocks first)
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > bound:
            sent.popitem(last=False)

    def route(self, prompt_ids: Sequence[int], loads: Sequence[Load], healthy: Sequence[bool]) -> int:
        """`pick` for the prompt, recorded."""
        if self.num_replicas == 1:  # (one engine process: no choice, so no prompt hashed on the front's loop)
            return self.pick((), loads, healthy)
        keys = self.keys(prompt_ids)
        replica = self.pick(keys, loads, healthy)
        self.record(replica, keys)
        return replica
