"""A small random-weight Llama written to disk, so demos and tests need no model hub.

``initializer_range=0.2`` makes the greedy outputs depend on every prompt token, so wrong KV
shows up as different tokens (with the default 0.02 a random model repeats one token).
"""

from __future__ import annotations

import json
from pathlib import Path

SPEC_FILE = "tieredkv_tiny_model.json"


def make_tiny_llama(
    directory: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 2048,
    max_positions: int = 16384,
    seed: int = 0,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
    head_dim: int | None = None,
) -> Path:
    """Write the model once; later calls with the same geometry reuse it.

    ``sliding_window`` with ``layer_types`` (``"sliding_attention"``/``"full_attention"`` per
    layer) makes a hybrid like Gemma 2 (vLLM's hybrid KV-cache manager gives each kind its own
    group); ``sliding_window`` alone an all-sliding model like Mistral. ``head_dim`` other than
    hidden / heads gives a large KV per token on a small hidden size (an 8B-class model's
    128 KiB per token: 32 layers, 8 KV heads, head dim 128, at hidden 256)."""
    path = Path(directory)
    spec = {
        "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
        "num_kv_heads": num_kv_heads, "vocab_size": vocab_size, "max_positions": max_positions,
        "seed": seed,
    }
    extra: dict = {}
    if sliding_window is not None:
        extra["sliding_window"] = spec["sliding_window"] = sliding_window
    if layer_types is not None:
        extra["layer_types"] = spec["layer_types"] = list(layer_types)
    if head_dim is not None:
        extra["head_dim"] = spec["head_dim"] = head_dim
    marker = path / SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
