"""Shared pieces of the speculative-decoding tests: prompts, engines, an oracle drafter."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams
from tiny_checkpoints import mtp_block_model
from shardserve.workers.messages import DraftBatch, DraftProposal, DraftResult

ARCHS = ["deepseek_v32", "glm_moe_dsa"]
BLOCK_SIZE = 4
NUM_BLOCKS = 96
VOCAB = 128


def prompts(lengths=(5, 13, 9), seed: int = 0) -> list[list[int]]:
    """Random prompts (ids 3.. so BOS/EOS/UNK never appear)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def make_llm(path: Path, k: int, policy: str = "fixed", **overrides) -> LLM:
    """A single-process engine on a tiny checkpoint: 4-token blocks, a 16-token step budget (the
    13-token prompt is prefilled in chunks next to other requests' decodes); ``k`` drafts every
    step unless ``policy="adaptive"``."""
    args = dict(model=str(path), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=16,
                speculative_tokens=k, speculative_policy=policy)
    return LLM(EngineArgs(**{**args, **overrides}), progress=False)


def greedy(max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


class OracleDrafter:
    """Runs the real draft worker (its caches stay in step) but proposes the known greedy
    continuation, with a wrong token wherever ``wrong(output_index)`` is true: drafts are then
    accepted up to a chosen point, so partial acceptance and rollback are exercised on purpose.

    Args:
        inner: the engine's drafter.
        core: the engine (to read each request's prompt and outputs).
        truth: prompt tuple -> its greedy continuation (long enough).
        wrong: output index -> whether to propose a wrong token there.
    """

    def __init__(self, inner, core, truth: dict[tuple, list[int]], wrong=lambda index: False) -> None:
        self.inner, self.core, self.truth, self.wrong = inner, core, truth, wrong
        self.real: list[tuple[list[int], list[int]]] = []   # (context, real MTP drafts) of every proposal

    def propose(self, batch: DraftBatch) -> DraftResult:
        real = self.inner.propose(batch)
        proposals = []
        for proposal in real.proposals:
            request = self.core.requests[proposal.req_id].request
            self.real.append((list(request.all_token_ids), list(proposal.token_ids)))
            start = request.num_output_tokens
            tokens = self.truth[tuple(request.prompt_token_ids)][start:start + len(proposal.token_ids)]
            tokens = [(t + 1) % VOCAB if self.wrong(start + j) else t for j, t in enumerate(tokens)]
            tokens += proposal.token_ids[len(tokens):]
            proposals.append(DraftProposal(proposal.req_id, tokens, proposal.probs_row))
        return DraftResult(proposals)


def install_oracle(llm: LLM, truth: dict[tuple, list[int]], wrong=lambda index: False) -> OracleDrafter:
    oracle = OracleDrafter(llm.core.speculator.drafter, llm.core, truth, wrong)
    llm.core.speculator.drafter = oracle
    return oracle



def record_preemptions(llm: LLM) -> list:
    """Wraps the engine's scheduler: the returned list fills with every step's preempted requests."""
    preempted = []
    schedule = llm.core.scheduler.schedule

    def spy():
        batch = schedule()
        preempted.extend(batch.preempted)
        return batch

    llm.core.scheduler.schedule = spy
    return preempted


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class StraightMTP:
    """The formula above from raw tensors; the block is transformers' layer (no cache)."""

    def __init__(self, arch: str, path: Path, config) -> None:
        tensors = load_file(str(path / "model.safetensors"))
        prefix = f"model.layers.{config.num_hidden_layers}."
        self.embed = tensors.get(prefix + "embed_tokens.weight", tensors["model.embed_tokens.weight"])
        self.head = tensors.get(prefix + "shared_head.head.weight", tensors["lm_head.weight"])
        self.enorm, self.hnorm = tensors[prefix + "enorm.weight"], tensors[prefix + "hnorm.weight"]
        self.eh_proj, self.head_norm = tensors[prefix + "eh_proj.weight"], tensors[prefix + "shared_head.norm.weight"]
        self.eps = config.rms_norm_eps
        self.block = mtp_block_model(arch, seed=0)
        # the block transformers holds is the one in the checkpoint
        attn_key = prefix + "self_attn.kv_a_proj_with_mqa.weight"
        assert torch.equal(self.block.model.layers[0].self_attn.kv_a_proj_with_mqa.weight, tensors[attn_key])

    @torch.no_grad()
    def __call__(self, next_tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries ``t = 0..T-1`` (positions) -> ``(logits [T, vocab], o [T, hidden])``."""
        fused = torch.cat((_rms(self.embed[next_tokens], self.enorm, self.eps), _rms(hidden, self.hnorm, self.eps)),
                          dim=-1) @ self.eh_proj.T
        captured = {}
        layer = self.block.model.layers[0]
        handle = layer.register_forward_hook(lambda mod, args, out: captured.update(o=out[0] if isinstance(out, tuple)
                                                                                     else out))
        try:
            self.block.model(inputs_embeds=fused[None])
        finally:
            handle.remove()
        out = captured["o"][0]
        return _rms(out, self.head_norm, self.eps) @ self.head.T, out

    def greedy_drafts(self, hf, context: list[int], num_drafts: int) -> list[int]:
        """The drafts the MTP proposes after ``context`` (greedy, chained), computed from scratch;
        ``hf`` is the main model (its final hidden states are ``h_t``). Entries whose top-2 logits
        are closer than 1e-3 are returned as None (float noise may flip them)."""
        with torch.no_grad():
            hidden = hf.model(torch.tensor([context[:-1]])).last_hidden_state[0]
        tokens, drafts = list(context), []
        for _ in range(num_drafts):
            logits, outs = self(tokens[1:], hidden)
            top2 = logits[-1].topk(2).values
            drafts.append(int(logits[-1].argmax()) if top2[0] - top2[1] > 1e-3 else None)
            tokens.append(int(logits[-1].argmax()))
            hidden = torch.cat((hidden, outs[-1:]))
        return drafts


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson goodness of fit; cells expecting < 5 are pooled into one."""
    small = expected < 5
    obs = torch.cat((observed[~small], observed[small].sum()[None]))
    exp = torch.cat((expected[~small], expected[small].sum()[None]))
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def two_sample_p(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Chi-square test of homogeneity of two count vectors (cells with < 10 in total pooled)."""
    total = counts_a + counts_b
    small = total < 10
    a = torch.cat((counts_a[~small], counts_a[small].sum()[None]))
    b = torch.cat((counts_b[~small], counts_b[small].sum()[None]))
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    n_a, n_b = a.sum(), b.sum()
    exp_a, exp_b = (a + b) * n_a / (n_a + n_b), (a + b) * n_b / (n_a + n_b)
    stat = ((a - exp_a) ** 2 / exp_a + (b - exp_b) ** 2 / exp_b).sum()
    return torch.special.gammaincc(torch.tensor((a.numel() - 1) / 2, dtype=torch.float64), stat / 2).item()
