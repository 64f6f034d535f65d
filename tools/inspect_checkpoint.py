"""Print what NanoInfer reads from a checkpoint: config, tensor types, tokenizer, chat template.

    python tools/inspect_checkpoint.py [MODEL]    # a short name, an HF directory or a .gguf file
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path

from nanoinfer.hub import DEFAULT_MODEL, KNOWN_MODELS, resolve_model_name


def tensor_types(path: Path) -> Counter:
    if path.is_dir():
        from safetensors import safe_open

        counts = Counter()
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    counts[str(f.get_slice(name).get_dtype())] += 1
        return counts
    from nanoinfer.loaders.gguf import open_gguf

    return Counter(t.tensor_type.name for t in open_gguf(path).tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    args = parser.parse_args()
    path = resolve_model_name(args.model) if args.model in KNOWN_MODELS else Path(args.model)
    if path.is_dir():
        from nanoinfer.loaders.hf import read_hf_config
        from nanoinfer.text.tokenizer import Tokenizer

        cfg, tokenizer = read_hf_config(path), Tokenizer.from_hf_dir(path)
    else:
        from nanoinfer.loaders.gguf import gguf_config, open_gguf
        from nanoinfer.text.tokenizer import Tokenizer

        header = open_gguf(path)
        cfg, tokenizer = gguf_config(header, path), Tokenizer.from_gguf(header, path)
    print(f"checkpoint: {path}")
    print(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
    print(f"tensor types: {dict(tensor_types(path))}")
    if tokenizer is None:
        print("tokenizer: none")
    else:
        print(f"tokenizer: vocab {tokenizer.vocab_size}, bos {tokenizer.bos_token!r}, eos ids {tokenizer.eos_token_ids}")
        print(f"chat template: {'yes' if tokenizer.chat_template else 'no'}")


if __name__ == "__main__":
    main()
