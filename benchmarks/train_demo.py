"""Train ``shakespeare-dsa-mtp``: a small DeepSeek-V3.2-architecture model with one MTP layer, on CPU.

Architecture: transformers' own ``DeepseekV32ForCausalLM`` (MLA, DSA lightning indexer on every
layer, MoE with a shared expert after one dense layer) plus one Multi-Token Prediction layer in
DeepSeek-V3's form (``eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)))`` -> one decoder block ->
``shared_head.norm`` -> the shared LM head, predicting ``x_{t+2}``); ``DEMO_SHAPE`` has the sizes.
Data: tinyshakespeare (``../shared/data/tinyshakespeare.txt``), a byte-level BPE tokenizer of about
2k tokens trained by ``tokenizers``; the last 10% of the tokens are held out for validation.

Four stages, the first three after the DeepSeek-V3.2 report (arXiv:2512.02556, Sec. 2.1.1):

1. dense: every attention dense (the indexer is bypassed), next-token loss + 0.3 x the MTP loss
   (DeepSeek-V3's lambda); MoE load balanced aux-loss-free (router bias +-0.001 per step by the
   sign of each expert's load, DeepSeek-V3 Sec. 2.1.2). Sequences of 512, then of 2048 tokens.
2. indexer warm-up: the model frozen, only the indexers (the MTP layer's too) train, by
   ``KL(p || softmax(I))`` where ``p`` is the dense attention of the layer summed over heads and
   L1-normalized, ``I`` the indexer logits.
3. sparse: attention over the indexer's top-k (``--top-k``); the model trains on the LM + MTP
   losses, each indexer on the KL restricted to its selected keys, its inputs detached from the
   model's graph.
4. distill: the main model frozen, the MTP layer alone learns the main model's next-token
   distribution (``KL(p_main(x_{t+2} | x_{<=t+1}) || p_mtp)``, sparse attention): what drafting is
   judged against. DeepSeek's MTP modules train jointly on the corpus at a scale where they agree
   with the model ~85-90 % of the time; a model this small needs the target's labels to get near.

Deterministic for a given ``--seed`` and ``--threads``. The default schedule takes 12-20 minutes
on 2 idle cores. It writes an HF checkpoint folder (``config.json``, ``model.safetensors`` with the
MTP layer as ``model.layers.{L}.*`` in DeepSeek's layout, tokenizer files, ``training_summary.json``)
that transformers' ``DeepseekV32ForCausalLM`` loads, by default into
``~/.cache/shardserve/shakespeare-dsa-mtp`` (``$SHARDSERVE_CACHE``), where the model name
``shakespeare-dsa-mtp`` finds it. Not a test: ``python benchmarks/train_demo.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "shakespeare-dsa-mtp"
MTP_LOSS_WEIGHT = 0.3          # DeepSeek-V3's lambda for the first 10T tokens
BIAS_UPDATE = 1e-3             # aux-loss-free balancing step (DeepSeek-V3's gamma)
# 6 layers: deep enough that the one-layer MTP draft costs a small share of a target step.
DEMO_SHAPE = dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, kv_lora_rank=64,
                  q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                  max_position_embeddings=2048, index_head_dim=32, index_n_heads=4, first_k_dense_replace=1)


@dataclass(slots=True)
class Schedule:
    """Steps, batch shapes and learning rates of the four stages."""

    dense_steps: int = 130            # of which the last `long_steps` use `long_len`
    long_steps: int = 30
    warmup_steps: int = 30            # indexer warm-up
    sparse_steps: int = 40
    seq_len: int = 512
    batch_size: int = 8
    long_len: int = 2048
    long_batch_size: int = 2
    sparse_len: int = 1024            # warm-up and sparse stages
    sparse_batch_size: int = 4
    lr: float = 2e-3
    indexer_lr: float = 1e-3
    sparse_lr: float = 3e-4
    distill_steps: int = 60           # the MTP layer alone, on the main model's predictions
    distill_lr: float = 1e-3


def default_data_path() -> Path:
    """tinyshakespeare beside the checkout (``../shared/data``), also from a git worktree one level deeper."""
    for base in (ROOT.parent, ROOT.parent.parent):
        path = base / "shared" / "data" / "tinyshakespeare.txt"
        if path.is_file():
            return path
    return ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on ``text``, as a transformers ``PreTrainedTokenizerFast``
    with ``<|bos|>`` (id 0) and ``<|eos|>`` (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>")


def demo_config(vocab_size: int, top_k: int, mtp_block: bool = False):
    """The transformers config of the main model, or (``mtp_block``) of a one-layer model whose
    layer is the MTP block (MoE). Eager attention (the warm-up reads its probabilities; the dense
    stage switches to SDPA)."""
    from transformers import DeepseekV32Config

    shape = dict(DEMO_SHAPE)
    if mtp_block:
        shape.update(num_hidden_layers=1, first_k_dense_replace=0)
    dense = shape["first_k_dense_replace"]
    config = DeepseekV32Config(vocab_size=vocab_size, index_topk=top_k, bos_token_id=0, eos_token_id=1,
                               mlp_layer_types=["dense"] * dense + ["sparse"] * (shape["num_hidden_layers"] - dense),
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               tie_word_embeddings=False, **shape)
    config._attn_implementation = "eager"
    config._experts_implementation = "grouped_mm"      # same math as the eager loop, faster on CPU
    return config


class DemoModel(nn.Module):
    """The main model and its MTP layer (the block is a one-layer ``DeepseekV32Model``, whose final
    norm is ``shared_head.norm``; embedding and LM head are the main model's).

    ``forward(ids [B, S]) -> (logits [B, S, V], mtp_logits [B, S - 1, V], attentions)``:
    ``mtp_logits[:, t]`` predicts ``ids[:, t + 2]`` from ``h_t`` and ``ids[:, t + 1]``;
    ``attentions`` (with ``output_attentions``, eager attention) holds each layer's
    ``[B, heads, S, S]`` probabilities, the main layers' then the MTP block's.
    """

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import DeepseekV32ForCausalLM, DeepseekV32Model
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RMSNorm

        self.main = DeepseekV32ForCausalLM(config)
        self.block = DeepseekV32Model(demo_config(config.vocab_size, config.index_topk, mtp_block=True))
        self.block.embed_tokens.requires_grad_(False)          # unused: the main embedding is shared
        hidden = config.hidden_size
        self.enorm = DeepseekV32RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = DeepseekV32RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, ids: torch.Tensor, output_attentions: bool = False):
        out = self.main.model(ids, output_attentions=output_attentions)
        hidden = out.last_hidden_state                                         # h_t (final-normed)
        mtp_logits, mtp_attentions = self.mtp(ids, hidden, output_attentions)
        attentions = (out.attentions or ()) + mtp_attentions
        return self.main.lm_head(hidden), mtp_logits, attentions

    def mtp(self, ids: torch.Tensor, hidden: torch.Tensor, output_attentions: bool = False):
        """The MTP layer over the main model's final-normed ``hidden [B, S, H]``: ``(mtp_logits
        [B, S - 1, V], its block's attentions)``."""
        embed = self.main.model.embed_tokens(ids[:, 1:])
        fused = self.eh_proj(torch.cat((self.enorm(embed), self.hnorm(hidden[:, :-1])), dim=-1))
        mtp = self.block(inputs_embeds=fused.float(), output_attentions=output_attentions)   # fp32 mask dtype
        return self.main.lm_head(mtp.last_hidden_state), mtp.attentions or ()

    def mtp_params(self) -> list[nn.Parameter]:
        """The MTP layer's own parameters but its indexer's (the shared embedding and head are the
        main model's)."""
        indexer = {id(p) for p in self.block.layers[0].self_attn.indexer.parameters()}
        own = list(self.block.parameters()) + [p for m in (self.enorm, self.hnorm, self.eh_proj) for p in m.parameters()]
        return [p for p in own if id(p) not in indexer and p.requires_grad]

    def indexers(self) -> list[nn.Module]:
        """Every DSA indexer, main layers first, then the MTP block's."""
        layers = list(self.main.model.layers) + list(self.block.layers)
        return [layer.self_attn.indexer for layer in layers]

    def routers(self) -> list[nn.Module]:
        return [layer.mlp.gate for layer in list(self.main.model.layers) + list(self.block.layers)
                if hasattr(layer.mlp, "gate")]


def lm_losses(logits: torch.Tensor, mtp_logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token and MTP (token after next) cross-entropies, nats."""
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, vocab), ids[:, 2:].reshape(-1))
    return main, mtp


@contextlib.contextmanager
def indexer_mode(model: DemoModel, top_k: int | None, attn_implementation: str = "eager"):
    """``top_k`` None: every indexer keeps all keys without scoring them (dense attention); else
    the indexers select ``top_k`` keys (transformers' own DSA path)."""
    saved = []
    for config in (model.main.config, model.block.config):
        config._attn_implementation = attn_implementation
    for indexer in model.indexers():
        saved.append(indexer.index_topk)
        if top_k is None:
            def keep_all(hidden, *args, **kwargs):
                batch, seq = hidden.shape[:2]
                return torch.arange(seq, dtype=torch.int32).expand(batch, seq, seq)
            indexer.forward = keep_all
        else:
            indexer.index_topk = top_k
    try:
        yield
    finally:
        for config in (model.main.config, model.block.config):
            config._attn_implementation = "eager"
        for indexer, k in zip(model.indexers(), saved):
            indexer.__dict__.pop("forward", None)
            indexer.index_topk = k


class IndexerInputs:
    """Captures each indexer's inputs ``(hidden, q_resid, (cos, sin))`` and its selection."""

    def __init__(self, indexers: list[nn.Module]) -> None:
        self.inputs, self.selected, self.handles = {}, {}, []
        for i, indexer in enumerate(indexers):
            self.handles.append(indexer.register_forward_pre_hook(self._pre(i)))
            self.handles.append(indexer.register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, args):
            self.inputs[i] = (args[0].detach().float(), args[1].detach().float(),
                              tuple(t.detach().float() for t in args[2]))
        return hook

    def _post(self, i):
        def hook(module, args, out):
            self.selected[i] = out
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def indexer_logits(indexer, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin) -> torch.Tensor:
    """transformers' ``DeepseekV32Indexer`` scores with gradients: ``[B, S, S]`` float32, ``-inf``
    at future keys."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    batch, seq, _ = hidden.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, seq, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, q_pass = q.split([rope, indexer.head_dim - rope], dim=-1)
    k_rot, k_pass = k.split([rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, *cos_sin, unsqueeze_dim=2)
    q, k = torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1).squeeze(2)
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden.float()).float() * indexer.n_heads ** -0.5
    logits = torch.einsum("bsh,bsht->bst", weights, scores)
    future = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).triu(1)
    return logits.masked_fill(future, float("-inf"))


def indexer_kl(model: DemoModel, captured: IndexerInputs, attentions, sparse: bool) -> torch.Tensor:
    """Sum over layers of the mean ``KL(p || softmax(I))``; ``p`` = attention summed over heads and
    L1-normalized. ``sparse``: both restricted to the selected keys (DeepSeek-V3.2 Sec. 2.1.1)."""
    total = 0.0
    for i, indexer in enumerate(model.indexers()):
        target = attentions[i].detach().float().sum(1)                       # [B, S, S]
        target = target / target.sum(-1, keepdim=True)
        logits = indexer_logits(indexer, *captured.inputs[i])
        if sparse:
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, captured.selected[i].long(), True)
            logits = logits.masked_fill(~keep, float("-inf"))
        log_q = torch.log_softmax(logits, dim=-1)
        kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - log_q), 0.0)
        total = total + kl.sum(-1).mean()
    return total


class RouterLoads:
    """Aux-loss-free balancing: counts each router's expert choices, then nudges its score bias."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers, self.counts = routers, [None] * len(routers)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, i):
        def hook(module, args, out):
            self.counts[i] = torch.bincount(out[2].flatten(), minlength=module.num_experts).float()
        return hook

    @torch.no_grad()
    def update(self) -> None:
        for router, counts in zip(self.routers, self.counts):
            if counts is not None:
                router.e_score_correction_bias += BIAS_UPDATE * torch.sign(counts.mean() - counts)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def lr_at(step: int, steps: int, peak: float, warmup: int = 20) -> float:
    """Linear warm-up, then cosine decay to 10% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def sample_batch(tokens: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq_len, (batch,), generator=gen)
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])


def optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def model_params(model: DemoModel) -> list[nn.Parameter]:
    """Everything but the indexers (which train on their own loss only)."""
    indexer_ids = {id(p) for indexer in model.indexers() for p in indexer.parameters()}
    return [p for p in model.parameters() if id(p) not in indexer_ids and p.requires_grad]


def run_stage(name: str, model: DemoModel, tokens, sched: Schedule, gen, log) -> None:
    """One training stage (see the module docstring); logs a line every 10 steps."""
    if name == "distill":
        return distill_stage(model, tokens, sched, gen, log)
    steps = {"dense": sched.dense_steps, "warmup": sched.warmup_steps, "sparse": sched.sparse_steps}[name]
    if name == "warmup":
        params, peak = [p for ix in model.indexers() for p in ix.parameters()], sched.indexer_lr
    else:
        params = model_params(model) + ([p for ix in model.indexers() for p in ix.parameters()]
                                        if name == "sparse" else [])
        peak = sched.lr if name == "dense" else sched.sparse_lr
    opt = optimizer(params, peak)
    loads = RouterLoads(model.routers()) if name != "warmup" else None
    captured = IndexerInputs(model.indexers()) if name != "dense" else None
    top_k = model.main.config.index_topk if name == "sparse" else None
    with indexer_mode(model, top_k, "sdpa" if name == "dense" else "eager"):
        for step in range(steps):
            if name != "dense":
                shape = sched.sparse_len, sched.sparse_batch_size
            elif step >= steps - sched.long_steps:
                shape = sched.long_len, sched.long_batch_size
            else:
                shape = sched.seq_len, sched.batch_size
            ids = sample_batch(tokens, *shape, gen)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, peak)
            loss, parts = stage_loss(name, model, ids, captured)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if loads is not None:
                loads.update()
            if step % 10 == 0 or step == steps - 1:
                log(f"{name} step {step + 1}/{steps} " + " ".join(f"{k} {v:.4f}" for k, v in parts.items()))
    for hooks in (loads, captured):
        if hooks is not None:
            hooks.close()


def distill_stage(model: DemoModel, tokens, sched: Schedule, gen, log) -> None:
    """Stage 4: the main model frozen (its routers too), only the MTP layer trains (its indexer
    stays as stage 3 left it), by ``KL(p_main || p_mtp)``: the main model's own distribution of
    ``x_{t+2}`` (its prediction at ``t + 1``) against the MTP layer's (self-distillation, as EAGLE
    and Medusa-2 train draft heads). A draft is accepted when it agrees with the target, so the
    target's predictions are the labels that matter, not the corpus's. Sparse attention, as
    served. Logs the KL and how often the two greedy tokens agree."""
    params = model.mtp_params()
    frozen = [p for p in model.main.parameters() if p.requires_grad]
    for p in frozen:   # the shared embedding and head too: no gradients computed for them
        p.requires_grad_(False)
    opt = optimizer(params, sched.distill_lr)
    loads = RouterLoads([layer.mlp.gate for layer in model.block.layers if hasattr(layer.mlp, "gate")])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with indexer_mode(model, model.main.config.index_topk):
        for step in range(sched.distill_steps):
            ids = sample_batch(tokens, sched.sparse_len, sched.sparse_batch_size, gen)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, sched.distill_steps, sched.distill_lr)
            with autocast:
                with torch.no_grad():
                    hidden = model.main.model(ids).last_hidden_state
                    target = model.main.lm_head(hidden[:, 1:]).float()          # predicts x_{t+2}
                mtp_logits, _ = model.mtp(ids, hidden)
            log_p, log_q = torch.log_softmax(target, -1), torch.log_softmax(mtp_logits.float(), -1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            kl.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            loads.update()
            if step % 10 == 0 or step == sched.distill_steps - 1:
                agree = (target.argmax(-1) == mtp_logits.argmax(-1)).float().mean().item()
                log(f"distill step {step + 1}/{sched.distill_steps} kl {kl.item():.4f} greedy_agree {agree:.4f}")
    loads.close()
    for p in frozen:
        p.requires_grad_(True)


def stage_loss(name: str, model: DemoModel, ids: torch.Tensor, captured) -> tuple[torch.Tensor, dict]:
    """The stage's loss and its parts (floats, for the log). The model runs under bf16 autocast
    (fp32 weights; CPUs with AVX512-BF16 run its matmuls about twice as fast); losses and the
    indexer KL are computed in fp32."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    if name == "warmup":
        with torch.no_grad(), autocast:
            _, _, attentions = model(ids, output_attentions=True)
        kl = indexer_kl(model, captured, attentions, sparse=False)
        return kl, {"indexer_kl": kl.item()}
    with autocast:
        logits, mtp_logits, attentions = model(ids, output_attentions=name == "sparse")
    main, mtp = lm_losses(logits.float(), mtp_logits.float(), ids)
    loss, parts = main + MTP_LOSS_WEIGHT * mtp, {"loss": main.item(), "mtp_loss": mtp.item()}
    if name == "sparse":
        kl = indexer_kl(model, captured, attentions, sparse=True)
        loss, parts["indexer_kl"] = loss + kl, kl.item()
    return loss, parts


def split_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, validation)``: the first 90% and the last 10% of the corpus's tokens."""
    cut = int(tokens.numel() * 0.9)
    return tokens[:cut], tokens[cut:]


def encode_corpus(tokenizer, path: Path) -> torch.Tensor:
    """The whole corpus as one ``[N]`` int64 tensor of token ids."""
    return torch.tensor(tokenizer(path.read_text(encoding="utf-8"))["input_ids"], dtype=torch.int64)


@torch.no_grad()
def save_checkpoint(model: DemoModel, tokenizer, out: Path, summary: dict) -> None:
    """Write the HF folder next to ``out`` and move it into place (never a half-written checkpoint).

    The MTP layer goes to ``model.layers.{L}.*`` (``L = num_hidden_layers``) with DeepSeek-V3's
    names: the decoder block (per-expert tensors, as ``save_pretrained`` writes them), ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding and LM head
    (``embed_tokens``, ``shared_head.head``); ``config.json`` gains ``num_nextn_predict_layers: 1``.
    """
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV32ForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    model.main.save_pretrained(str(tmp))
    tensors = load_file(str(tmp / "model.safetensors"))
    prefix = f"model.layers.{model.main.config.num_hidden_layers}."
    with tempfile.TemporaryDirectory() as block_dir:
        holder = DeepseekV32ForCausalLM(model.block.config)
        holder.model = model.block
        holder.save_pretrained(block_dir)
        for name, tensor in load_file(str(Path(block_dir) / "model.safetensors")).items():
            if name.startswith("model.layers.0."):
                tensors[prefix + name[len("model.layers.0."):]] = tensor
    extra = {"enorm.weight": model.enorm.weight, "hnorm.weight": model.hnorm.weight,
             "eh_proj.weight": model.eh_proj.weight, "shared_head.norm.weight": model.block.norm.weight,
             "embed_tokens.weight": model.main.model.embed_tokens.weight,
             "shared_head.head.weight": model.main.lm_head.weight}
    tensors.update({prefix + name: tensor.detach().clone().contiguous() for name, tensor in extra.items()})
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "training_summary.json").write_text(json.dumps(summary, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from shardserve.workers.model_source import cache_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=default_data_path(), help="tinyshakespeare.txt")
    parser.add_argument("--out", type=Path, default=cache_dir() / MODEL_NAME, help="checkpoint folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=64, help="DSA top-k of the sparse stage (config index_topk)")
    for field, value in asdict(Schedule()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"no corpus at {args.data}: pass --data path/to/tinyshakespeare.txt "
                     "(karpathy/char-rnn data/tinyshakespeare/input.txt)")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Train and write the checkpoint; returns its folder."""
    args = parse_args(argv)
    sched = Schedule(**{f: getattr(args, f) for f in asdict(Schedule())})
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def log(message: str) -> None:   # wall time, and CPU time (the wall time an idle machine would need x threads)
        print(f"[{time.perf_counter() - started:7.1f} s, cpu {time.process_time():7.1f} s] {message}", flush=True)

    tokenizer = train_tokenizer(args.data.read_text(encoding="utf-8"), args.vocab_size)
    train, validation = split_tokens(encode_corpus(tokenizer, args.data))
    log(f"tokenizer: {len(tokenizer)} tokens; corpus {train.numel()} train + {validation.numel()} validation tokens")
    torch.manual_seed(args.seed)
    model = DemoModel(demo_config(len(tokenizer), args.top_k))
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters (MTP layer included)")
    gen = torch.Generator().manual_seed(args.seed)
    for stage in ("dense", "warmup", "sparse", "distill"):
        run_stage(stage, model, train, sched, gen, log)
    summary = {"seed": args.seed, "threads": args.threads, "schedule": asdict(sched), "top_k": args.top_k,
               "train_tokens": train.numel(), "validation_tokens": validation.numel(),
               "seconds": round(time.perf_counter() - started, 1), "cpu_seconds": round(time.process_time(), 1)}
    save_checkpoint(model, tokenizer, args.out, summary)
    log(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
