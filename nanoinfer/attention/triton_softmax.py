"""The online-softmax step the Triton attention kernels share (triton_paged.py, triton_decode_cc.py)."""

import triton
import triton.language as tl


@triton.jit
def online_softmax(s, m):
    """One tile of scores s [rows, keys] (base 2, masked keys -inf) against running maxima m
    [rows]: the new maxima, the factor that rescales the sums so far, and the tile's weights.
    A row with every key masked so far keeps m = -inf; subtracting 0 instead avoids
    -inf - -inf = NaN and leaves its weights and factor at exactly 0."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m - m_safe), tl.exp2(s - m_safe[:, None])
