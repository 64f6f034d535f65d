"""Write a checkpoint directory without weights: a real shape's config.json and the default
model's tokenizer, for `--load-format dummy` where no real checkpoint is at hand (the GPU
machine: no hub, no network).

    python bench/dummy_checkpoint.py qwen3-0.6b OUT_DIR

The tokenizer (SmolLM2's byte-level BPE and ChatML template, 49,152 tokens) is smaller than
the shape's vocabulary, which only means some embedding rows are never used.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write(shape: str, out: Path) -> None:
    import transformers

    from bench.shapes import HF_CONFIGS
    from nanoinfer.loaders.gguf import open_gguf
    from nanoinfer.hub import DEFAULT_MODEL, resolve_model_name
    from nanoinfer.text.tokenizer import Tokenizer

    cls, fields = HF_CONFIGS[shape]
    config = getattr(transformers, cls)(**fields, max_position_embeddings=40960)
    out.mkdir(parents=True, exist_ok=True)
    raw = config.to_dict()
    raw["architectures"] = [cls.replace("Config", "ForCausalLM")]
    raw["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    gguf_path = resolve_model_name(DEFAULT_MODEL)
    tokenizer = Tokenizer.from_gguf(open_gguf(gguf_path), gguf_path)
    tokenizer.save_hf(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    write(args.shape, args.out)
    print(f"wrote {args.out}: config.json ({args.shape}), tokenizer.json, tokenizer_config.json")


if __name__ == "__main__":
    main()
