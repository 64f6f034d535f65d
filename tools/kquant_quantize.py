"""Round-to-nearest quantizers for GGUF's Q4_K, Q5_K and Q6_K (numpy): small K-quant data for tests, and a fallback for tools/make_q4_k_m.py.

gguf-py reads these types but cannot write them, and tests have no llama.cpp. These follow the
formats' definitions (ggml's block_q4_K, block_q5_K, block_q6_K) with the plainest choices:
each sub-block's scale and min from its own range, the super-block's fp16 factors from the
largest of those, everything rounded to nearest. llama.cpp's quantizer searches for better
scales (lower error); any valid blocks serve the kernels' tests equally.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K, Q5_K, Q6_K = 12, 13, 14


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def pack_q45k(d, dmin, sc, mn, q, qtype: int) -> np.ndarray:
    """Fields of n super-blocks -> their bytes: d, dmin [n] fp16, sc, mn [n, 8] 6-bit, q [n, 8, 32]."""
    n = q.shape[0]
    scales = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),  # bytes 0-3: scales 0-3, top bits of scales 4-7
        (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),  # bytes 4-7: mins 0-3, top bits of mins 4-7
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),  # bytes 8-11: low nibbles of scales/mins 4-7
    ], axis=1).astype(np.uint8)
    low = (q & 0x0F).reshape(n, 4, 2, 32)  # 32 bytes hold sub-blocks 2c (low nibble) and 2c+1 (high)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128).astype(np.uint8)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if qtype == Q5_K:  # bit 4 of value i of sub-block j is bit j of qh[i]
        parts.append(sum((q[:, j] >> 4).astype(np.uint8) << j for j in range(8)).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=1)


def pack_q6k(d, scale, q) -> np.ndarray:
    """d [n] fp16, scale [n, 16] int8, q [n, 256] in [0, 64) -> bytes [n, 210]."""
    n = q.shape[0]
    low = (q & 0x0F).reshape(n, 2, 2, 64)  # each half: 64 bytes, low nibble then high nibble
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128).astype(np.uint8)
    high = (q >> 4).reshape(n, 2, 4, 32)  # each half: 32 bytes, 2 bits for each of 4 groups of 32
    qh = sum(high[:, :, g].astype(np.uint8) << (2 * g) for g in range(4)).astype(np.uint8).reshape(n, 64)
    return np.concatenate([ql, qh, scale.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) -> the rows' super-block bytes [rows, cols // 256 * size]."""
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"K-quant rows are whole super-blocks of 256 values, not {cols}")
    x = w.astype(np.float32).reshape(-1, QK_K)
    if qtype == Q6_K:
        g = x.reshape(-1, 16, 16)
        amax_i = np.abs(g).argmax(-1)
        peak = np.take_along_axis(g, amax_i[..., None], -1)[..., 0]
        sub = peak / -32  # the sub-block's largest magnitude at -32 (q - 32 spans -32..31)
        big = np.abs(sub).max(-1)
        d = (big / 127).astype(np.float16)
        d32 = np.where(d.astype(np.float32) > 0, d.astype(np.float32), 1)
        scale = np.clip(np.rint(sub / d32[:, None]), -127, 127).astype(np.int8)
        step = d.astype(np.float32)[:, None] * scale.astype(np.float32)
        safe = np.where(step != 0, step, 1)
        q = np.where(step[..., None] != 0, np.clip(np.rint(g / safe[..., None]), -32, 31), 0) + 32
        return pack_q6k(d, scale, q.astype(np.uint8).reshape(-1, QK_K)).reshape(rows, -1)
    qmax = 15 if qtype == Q4_K else 31
    g = x.reshape(-1, 8, 32)
    low = np.minimum(g.min(-1), 0)  # value = d sc q - dmin m, m >= 0: the min is at most 0
    step = (g.max(-1) - low) / qmax
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    d32, dmin32 = (np.where(v.astype(np.float32) > 0, v.astype(np.float32), 1) for v in (d, dmin))
    sc = np.clip(np.rint(step / d32[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin32[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    safe = np.where(scale != 0, scale, 1)
    q = np.where(scale[..., None] != 0, np.clip(np.rint((g + offset[..., None]) / safe[..., None]), 0, qmax), 0)
    return pack_q45k(d, dmin, sc, mn, q.astype(np.uint8), qtype).reshape(rows, -1)
