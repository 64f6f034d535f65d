"""StepTimer: host seconds per step phase (benchmarks read them) and, on request, NVTX ranges.

A step's phases, in order: schedule (plan and apply), batch (the step's rows), forward
(launched), sample (launched), resolve (its tokens read and applied). `next(name)` ends the
phase running and starts `name`; `end()` ends the step.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, nvtx: bool = False):
        """`nvtx`: an NVTX range around each phase, for Nsight Systems (CUDA only)."""
        self.phase_times: dict[str, float] = {}  # seconds per phase, summed over the steps
        self.nvtx = nvtx
        self._phase: str | None = None
        self._since = 0.0

    def start(self) -> float:
        """The step begins (with its schedule phase); the time."""
        self._phase = None
        return self.next("schedule")

    def next(self, name: str | None) -> float:
        """End the phase running, start `name` (None: the step is over); the time."""
        now = time.perf_counter()
        if self._phase is not None:
            self.phase_times[self._phase] = self.phase_times.get(self._phase, 0.0) + now - self._since
            if self.nvtx:
                torch.cuda.nvtx.range_pop()
        if name is not None and self.nvtx:
            torch.cuda.nvtx.range_push(f"nanoinfer.{name}")
        self._phase, self._since = name, now
        return now

    def end(self) -> float:
        return self.next(None)
