"""Triton's one-time set-up in a process, begun on a thread while the weights load.

Before the first Triton kernel of a process looks in the kernel cache, Triton computes its
own cache key: a sha256 of its compiler's sources and of libtriton.so (~400 MB), 0.3–2 s by
host, on the start's path even when every kernel is cached (most of a warm start's "sampler
draw compile" row in bench/cold_start.py). The key is kept for the process
(functools.lru_cache), so computing it on a thread while the loader reads and places the
weights takes it off that path: hashlib lets go of the GIL over large buffers, and the file
reads do too. Nothing here touches the GPU.
"""

from __future__ import annotations

import threading


def _key() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # (no Triton: the kernels that need it are not picked either)
        return
    triton_key()


def begin() -> threading.Thread:
    """Start computing Triton's cache key (and importing Triton) on a daemon thread; the first
    kernel launch then finds it computed, or waits only for the rest of it."""
    thread = threading.Thread(target=_key, name="triton-setup", daemon=True)
    thread.start()
    return thread
