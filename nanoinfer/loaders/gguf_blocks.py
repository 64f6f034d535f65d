"""GGUF's 4- and 8-bit blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q8_0) read as a GroupedWeight, without dequantizing:
the GGUF loader's, and the CPU's Q4_K weights put in a device's form (nanoinfer/loaders/params.py)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K

from nanoinfer.quant.quantized import GroupedWeight

# Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q8_0 store, per group of 32 inputs, unsigned integers with
# one scale and one min (Q4_K derives them from a 256-wide superblock's two fp16 factors and
# 6-bit multipliers; 5 bits fit GroupedWeight's 8-bit form), so `GroupedWeight` holds the file's
# values exactly and its packed forms compute with them. The layouts are ggml's (ggml-quants.c);
# tests check every one against gguf-py's dequantization. On the CPU the K-quants (Q4_K, Q5_K,
# Q6_K) load as KQuantWeight instead, the file's super-blocks as they are.

GROUPED_TYPES = frozenset((QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q8_0))
KQUANT_TYPES = frozenset((QT.Q4_K, QT.Q5_K, QT.Q6_K))


def _f16(raw: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks] fp32."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32]: the low nibbles are elements 0-15, the high ones 16-31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def grouped_weight(data: np.ndarray, qtype: QT, rows: int, cols: int) -> GroupedWeight:
    """The [rows, cols] matrix whose raw GGUF bytes are `data` ([rows, bytes per row] uint8)."""
    if qtype not in GROUPED_TYPES:
        raise ValueError(f"{qtype.name} has no grouped form (expected one of {sorted(t.name for t in GROUPED_TYPES)})")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * cols // (256 if qtype == QT.Q4_K else 32), -1)
    bits = 4
    if qtype == QT.Q4_0:  # d, qs[16]: w = d * (q - 8)
        d = _f16(blocks[:, :2])
        q, scale, low = _nibbles(blocks[:, 2:]), d, -8 * d
    elif qtype == QT.Q4_1:  # d, m, qs[16]: w = d * q + m
        d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        q, scale, low = _nibbles(blocks[:, 4:]), d, m
    elif qtype in (QT.Q5_0, QT.Q5_1):  # d, (m,) qh[4], qs[16]: w = d * (q - 16) or d * q + m, q of 5 bits
        d, start = _f16(blocks[:, :2]), 2 if qtype == QT.Q5_0 else 4
        low = -16 * d if qtype == QT.Q5_0 else _f16(blocks[:, 2:4])
        qh = blocks[:, start:start + 4].copy().view("<u4")  # bit i: the high bit of element i
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q, scale, bits = _nibbles(blocks[:, start + 4:]) | high << 4, d, 8
    elif qtype == QT.Q8_0:  # d, qs[32] int8: w = d * q = d * (q + 128) - 128 d
        d = _f16(blocks[:, :2])
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scale, low, bits = d, -128 * d, 8
    else:  # Q4_K: d, dmin, scales[12], qs[128]; sub-block j: w = d * sc_j * q - dmin * m_j
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)
        low = (-dmin[:, None] * m.astype(np.float32)).reshape(-1)
        # 32 bytes hold two sub-blocks: the first in the low nibbles, the second in the high.
        qs = blocks[:, 16:].reshape(-1, 4, 32)
        q = np.stack((qs & 0x0F, qs >> 4), axis=2)  # [blocks, 4, 2, 32]
    groups = cols // 32
    return GroupedWeight(torch.from_numpy(np.ascontiguousarray(q).reshape(rows, cols)),
                         torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, groups)),
                         torch.from_numpy(np.ascontiguousarray(low, dtype=np.float32).reshape(rows, groups)), bits)
