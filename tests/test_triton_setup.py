"""Triton's set-up begun on a thread (nanoinfer/backends/cuda/triton_setup.py): it ends, and leaves the key Triton would compute."""

import pytest

from nanoinfer.backends.cuda import triton_setup


def test_the_setup_thread_ends_and_caches_tritons_own_key():
    thread = triton_setup.begin()
    assert thread.daemon
    thread.join(timeout=120)
    assert not thread.is_alive()
    cache = pytest.importorskip("triton.runtime.cache")  # (CI's CPU torch comes without Triton)
    assert cache.triton_key.cache_info().currsize == 1  # (computed on the thread: the first launch finds it)
    assert cache.triton_key() == cache.triton_key.__wrapped__()  # (the key Triton computes itself)
