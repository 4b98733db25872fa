"""``--dsa-sink`` reaches the MTP draft's own indexer: on a checkpoint whose indexers (the MTP
layer's included) rank token 0 last (``crafted_indexer.py``), every draft selection keeps position
0 of its sequence, and speculative greedy output still equals plain greedy decoding with the sink."""

from __future__ import annotations

import pytest

from crafted_indexer import craft_marker_checkpoint
from spec_helpers import greedy, make_llm, prompts
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def sink_mtp_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32-mtp-sink")
    write_tiny_checkpoint("deepseek_v32", path, seed=0, mtp=True, mtp_own_head=True, tokenizer=True)
    craft_marker_checkpoint(path, marker_ids=set(range(1, 128)), never_emit={0})
    return path


def _draft_rows(llm, monkeypatch) -> list:
    """Every selection the draft model's indexer returns from now on."""
    (attn,) = llm.drafter.model.attention_layers()
    rows, inner = [], attn.indexer.forward

    def forward(*args, **kwargs):
        topk = inner(*args, **kwargs)
        if topk is not None:
            rows.append(topk)
        return topk

    monkeypatch.setattr(attn.indexer, "forward", forward)
    return rows


@pytest.mark.parametrize("sink", [0, 1])
def test_draft_indexer_keeps_each_sequences_position_0(sink_mtp_checkpoint, sink, monkeypatch):
    batch = [[0] + p for p in prompts((12, 20, 9), seed=3)]
    plain = make_llm(sink_mtp_checkpoint, 0, dsa_sink=sink).generate(batch, greedy(12))
    llm = make_llm(sink_mtp_checkpoint, 2, dsa_sink=sink)
    assert llm.drafter.model.attention_layers()[0].indexer.sink == sink
    rows = _draft_rows(llm, monkeypatch)
    done = llm.generate(batch, greedy(12))
    assert [d.token_ids for d in done] == [d.token_ids for d in plain]
    long_rows = [r[(r >= 0).all(-1)] for r in rows]            # rows that saw more keys than k
    assert sum(r.shape[0] for r in long_rows) > 10
    keeps_0 = [bool((r == 0).any(-1).all()) for r in long_rows if r.shape[0]]
    assert all(keeps_0) if sink else not any(keeps_0)
