"""Gemma 2 and Gemma 3 GGUFs (architectures gemma2, gemma3): their config's flags as llama.cpp reads the metadata.

llama.cpp's converter (convert_hf_to_gguf.py's Gemma2Model, Gemma3Model) writes the norms with Gemma's +1
already added, `attn_norm` / `post_attention_norm` around the attention and `ffn_norm` / `post_ffw_norm`
around the MLP, the soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`) and the window
(`attention.sliding_window`); what it leaves out llama.cpp fixes by architecture, and so do we: Gemma 2 windows
every other layer from layer 0, Gemma 3 five of each six, Gemma 3's windowed layers rotate by base 10,000
unscaled, and attention's scale is 1/sqrt(head_dim) but for the 27B models (46 and 62 layers): 1/sqrt(hidden /
heads), their query_pre_attn_scalar.
"""

from __future__ import annotations

from typing import Any

from nanoinfer.gguf_file import GGUFFile
from nanoinfer.model.config_checks import dimension, positive_number

GEMMA_ARCHITECTURES = ("gemma2", "gemma3")  # (their tensors' names: nanoinfer.loaders.gguf.GEMMA_LAYER_NAMES)
_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}  # every pattern-th layer global (llama.cpp's set_swa_pattern)
_LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}


def gemma_fields(gguf_file: GGUFFile, arch: str, path, *, hidden: int, num_heads: int, head_dim: int,
                 num_layers: int) -> dict[str, Any]:
    """ModelConfig's Gemma fields from the metadata (none for another architecture)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}

    def cap(name: str, default: float | None) -> float | None:
        value = gguf_file.scalar(f"{arch}.{name}", default)
        return None if not value else positive_number(f"{arch}.{name}", value, path)  # (0: none, as llama.cpp)

    window = gguf_file.scalar(f"{arch}.attention.sliding_window", 0)
    window = dimension(f"{arch}.attention.sliding_window", window, path) if window else None
    pattern = _WINDOW_PATTERN[arch]
    windowed = tuple((i + 1) % pattern != 0 for i in range(num_layers))
    largest = num_layers == _LAYERS_OF_27B[arch]
    return dict(hidden_act="gelu_tanh", embed_scale=hidden**0.5, sandwich_norms=True,
                attn_softcap=cap("attn_logit_softcapping", 50.0) if arch == "gemma2" else None,
                final_softcap=cap("final_logit_softcapping", 30.0 if arch == "gemma2" else None),
                query_pre_attn_scalar=float(hidden // num_heads if largest else head_dim),
                sliding_window=window, windowed_layers=None if window is None or all(windowed) else windowed,
                rope_local_theta=10_000.0 if arch == "gemma3" and window is not None else None)
