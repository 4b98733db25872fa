"""Tiny DSA checkpoints whose lightning indexer is hand-set: "marker" tokens score high at every
layer, every other token scores exactly 0.

How (every layer, the MTP layer included when there is one):

- Residual channel 0 carries ``+M`` for marker tokens and ``-M`` for the others, channel 1 carries
  ``+M`` for every token; no layer writes to either (rows 0 and 1 of every ``o_proj`` and
  ``down_proj`` are zero), so each layer's normed input ``x`` has ``sign(x[0])`` = marker or not
  and ``x[1] > 0``. The MTP's ``eh_proj`` copies channel 0 from the target's hidden state ``h_t``
  (so MTP entry ``t`` is marked like token ``t``) and channel 1 from the embedding.
- Indexer key: ``wk`` reads only channel 0 along a zero-mean vector ``v`` that is zero on the RoPE
  dims, so ``LayerNorm(wk x) = +-v_hat``; the LayerNorm bias adds a small random RoPE part, so
  keys at different positions score differently.
- Indexer query: its non-RoPE part is ``gamma * v_hat`` times a q-latent entry fed by channel 1
  (always positive); its RoPE part is random. Head weights read channel 1 (always positive).

So for every query: a marker key scores about ``+30`` per head (plus a few units of RoPE term), a
non-marker key ``relu(-30 + ...) = 0``. The LM head gives every id in ``never_emit`` a very low
logit, so greedy decoding never produces them. The model stays a real DeepSeek-V3.2 / GLM-5
checkpoint that transformers loads (the parity oracle).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MARK = 4.0          # |residual channel 0| and channel 1
GAMMA = 1.0         # weight of the marker term in the indexer query


def _unit_marker_vector(head_dim: int, rope_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Zero-mean, unit-variance over all dims, zero on the RoPE dims: ``LayerNorm(c * v) = sign(c) * v``."""
    v = torch.zeros(head_dim)
    rest = torch.randn(head_dim - rope_dim, generator=gen)
    v[rope_dim:] = rest - rest.mean()
    return v / v.pow(2).mean().sqrt()


def _craft_indexer(tensors: dict, prefix: str, config: dict, gen: torch.Generator) -> None:
    heads, dim, rope = config["index_n_heads"], config["index_head_dim"], config["qk_rope_head_dim"]
    hidden, q_rank = config["hidden_size"], config["q_lora_rank"]
    v_hat = _unit_marker_vector(dim, rope, gen)
    wk = torch.zeros(dim, hidden)
    wk[:, 0] = v_hat
    tensors[prefix + "indexer.wk.weight"] = wk
    tensors[prefix + "indexer.k_norm.weight"] = torch.ones(dim)
    bias = torch.zeros(dim)
    bias[:rope] = 0.3 * torch.randn(rope, generator=gen)
    tensors[prefix + "indexer.k_norm.bias"] = bias
    latent = q_rank - 1                                   # the q-latent entry fed by channel 1
    q_a = tensors[prefix + "q_a_proj.weight"]
    q_a[latent] = 0.0
    q_a[latent, 1] = 3.0
    wq_b = torch.zeros(heads, dim, q_rank)
    wq_b[:, :rope] = torch.randn(heads, rope, q_rank, generator=gen) / q_rank ** 0.5
    wq_b[:, rope:, latent] = GAMMA * v_hat[rope:]
    tensors[prefix + "indexer.wq_b.weight"] = wq_b.view(heads * dim, q_rank)
    weights = torch.zeros(heads, hidden)
    weights[:, 1] = 0.5 + torch.rand(heads, generator=gen)
    tensors[prefix + "indexer.weights_proj.weight"] = weights


def craft_marker_checkpoint(path: str | Path, marker_ids: set[int], never_emit: set[int] = frozenset(),
                            seed: int = 0) -> None:
    """Rewrite the checkpoint at ``path`` in place (see the module docstring).

    Args:
        path: a tiny DSA checkpoint folder (``tiny_checkpoints.write_tiny_checkpoint``).
        marker_ids: token ids whose indexer keys score high.
        never_emit: token ids the LM head (and the MTP head) never predicts under greedy decoding.
        seed: seed of the random RoPE parts.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    markers = torch.zeros(config["vocab_size"], dtype=torch.bool)
    markers[sorted(marker_ids)] = True
    for name, tensor in tensors.items():
        if name.endswith("embed_tokens.weight"):          # the model's and the MTP layer's own copy
            tensor[:, 0] = torch.where(markers, MARK, -MARK)
            tensor[:, 1] = MARK
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[:2] = 0.0                               # no layer writes channels 0 and 1
        if name.endswith("eh_proj.weight"):   # MTP entry t: channel 0 from h_t (token t's marker), 1 from x_{t+1}
            tensor[:2] = 0.0
            tensor[0, config["hidden_size"]] = tensor[1, 1] = 1.0
        if name.endswith("self_attn.indexer.wk.weight"):
            _craft_indexer(tensors, name[: -len("indexer.wk.weight")], config, gen)
        if name.endswith(("lm_head.weight", "shared_head.head.weight")):
            tensor[sorted(never_emit), 1] = -50.0        # x[1] > 0: a large negative logit
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
