"""GGUF tensor names -> Hugging Face tensor names, one table per architecture.

Names follow llama.cpp's ``gguf-py/gguf/constants.py`` (``MODEL_TENSORS``); ``{bid}`` is the
block (layer) index.
"""

from __future__ import annotations

import re

# NOTE: one table per GGUF ``general.architecture``; add an architecture by adding a table.
GGUF_TO_HF: dict[str, dict[str, str]] = {
    "llama": {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "blk.{bid}.attn_norm.weight": "model.layers.{bid}.input_layernorm.weight",
        "blk.{bid}.attn_q.weight": "model.layers.{bid}.self_attn.q_proj.weight",
        "blk.{bid}.attn_k.weight": "model.layers.{bid}.self_attn.k_proj.weight",
        "blk.{bid}.attn_v.weight": "model.layers.{bid}.self_attn.v_proj.weight",
        "blk.{bid}.attn_output.weight": "model.layers.{bid}.self_attn.o_proj.weight",
        "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
        "blk.{bid}.ffn_gate.weight": "model.layers.{bid}.mlp.gate_proj.weight",
        "blk.{bid}.ffn_up.weight": "model.layers.{bid}.mlp.up_proj.weight",
        "blk.{bid}.ffn_down.weight": "model.layers.{bid}.mlp.down_proj.weight",
    },
}

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def gguf_to_hf_name(arch: str, gguf_name: str) -> str | None:
    """Map one GGUF tensor name to its HF name; ``None`` for tensors the model does not use
    (e.g. ``rope_freqs.weight``).

    Raises:
        KeyError: no table for ``arch``.
    """
    table = GGUF_TO_HF.get(arch)
    if table is None:
        raise KeyError(f"no GGUF tensor-name table for architecture {arch!r} (known: {sorted(GGUF_TO_HF)})")
    match = _BLOCK.match(gguf_name)
    if match is None:
        return table.get(gguf_name)
    bid = match.group(1)
    template = table.get(_BLOCK.sub("blk.{bid}.", gguf_name, count=1))
    return None if template is None else template.format(bid=bid)
