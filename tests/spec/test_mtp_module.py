"""The MTP draft model against a straight torch implementation of DeepSeek-V3 Sec. 2.2 written
here from the raw checkpoint tensors:

    h'_t = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)));  o_t = block(h'_t)
    logits_t = shared_head.head(shared_head.norm(o_t))

``block`` is transformers' own decoder layer that wrote the MTP block tensors (MLA + DSA indexer +
MoE); ``h_t`` is transformers' final hidden state of the main model. Our side runs through the
DraftWorker on a paged cache with scattered blocks, in two chunks, then chains drafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spec_helpers import StraightMTP
from tiny_checkpoints import write_tiny_checkpoint
from shardserve.workers.draft_buffers import BufferSizes
from shardserve.workers.draft_worker import DraftWorker
from shardserve.workers.messages import DraftBatch, DraftRequest, NewRequestData, SamplingOptions
from shardserve.workers.model_runner import apply_request_diffs
from shardserve.workers.model_source import ModelFiles, load_config

ARCHS = ["deepseek_v32", "glm_moe_dsa"]
BLOCK_SIZE = 4


def _worker(path: Path) -> DraftWorker:
    files = ModelFiles(path.name, path)
    config = load_config(files)
    worker = DraftWorker()
    worker.load(files, config, BufferSizes(64, 4, 3), BLOCK_SIZE, 24)
    return worker


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_logits_match_straight_formula(mtp_checkpoint, arch):
    ckpt = mtp_checkpoint(arch)
    config = load_config(ModelFiles(ckpt.path.name, ckpt.path))
    tokens = torch.randint(2, config.vocab_size, (22,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        target_hidden = ckpt.hf.model(torch.tensor([tokens])).last_hidden_state[0]   # [T, hidden], final-normed
    straight = StraightMTP(arch, ckpt.path, config)
    ref_logits, ref_out = straight(tokens[1:], target_hidden[:-1])                  # entries 0..T-2

    worker = _worker(ckpt.path)
    worker.requests.clear()
    blocks = torch.randperm(24, generator=torch.Generator().manual_seed(2)).tolist()[:8]   # scattered blocks
    apply_request_diffs(worker.requests, [], [NewRequestData("a", SamplingOptions(temperature=0))],
                        [DraftRequest("a", [], 0, blocks, 0, 0)])
    with torch.inference_mode():
        first = worker._forward(["a"], [0], [9], tokens[1:10], target_hidden[:9])     # two chunks
        second = worker._forward(["a"], [9], [12], tokens[10:], target_hidden[9:21])
        ours = worker.model.compute_logits(torch.cat((first, second)))
    diff = (ours - ref_logits).abs().max().item()
    print(f"{arch}: MTP logits max |ours - straight| = {diff:.2e}")
    assert diff < 1e-4, f"{arch}: MTP logits differ by {diff}"
    assert worker.model.mtp.self_attn.indexer is not None and worker.model.top_k == config.index_topk
    assert worker.model.top_k < len(tokens), "the indexer must actually select (sequence longer than top-k)"

    # Chained drafts: draft j+1 = MTP(token = draft j, h = o of the previous step) at the next position.
    chain_tokens, chain_out = list(tokens), ref_out[-1]
    expected = [int(ref_logits[-1].argmax())]
    hidden = target_hidden[:-1]
    for _ in range(2):
        chain_tokens.append(expected[-1])
        hidden = torch.cat((hidden, chain_out[None]))
        logits, outs = straight(chain_tokens[1:], hidden)
        chain_out = outs[-1]
        expected.append(int(logits[-1].argmax()))
    # Propose through the public entry point on a fresh cache: entries in one batch, 3 chained drafts.
    worker.requests.clear()
    batch = DraftBatch([NewRequestData("b", SamplingOptions(temperature=0))],
                       [DraftRequest("b", tokens[1:], 0, blocks, 3, 0)], hidden_rows=list(range(len(tokens) - 1)),
                       hidden_states=target_hidden[:-1])
    (proposal,) = worker.propose(batch).proposals
    assert proposal.token_ids == expected and proposal.probs_row == -1


def test_mtp_missing_layer_is_an_error(tmp_path):
    """A checkpoint without MTP layers cannot be a draft model: a clear error, not garbage."""
    worker = DraftWorker()
    path = tmp_path / "no-mtp"
    write_tiny_checkpoint("deepseek_v32", path)
    files = ModelFiles(path.name, path)
    with pytest.raises(ValueError, match="no MTP layers"):
        worker.load_weights(files, load_config(files), BufferSizes(8, 1, 1), BLOCK_SIZE)
