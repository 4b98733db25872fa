"""Incremental detokenization on the real SmolLM2 tokenizer: UTF-8 safety and stop strings."""

from __future__ import annotations

import pytest

from shardserve.cluster.engine.detokenizer import IncrementalDetokenizer
from shardserve.cluster.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(smollm2_files):
    return load_tokenizer(smollm2_files)


def stream(tokenizer, ids, stop=None):
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say:")["input_ids"], stop)
    deltas = []
    for token in ids:
        detok.add(token)
        deltas.append(detok.delta(final=detok.stopped))
        if detok.stopped:
            break
    deltas.append(detok.delta(final=True))
    return deltas, detok


def test_multibyte_characters_are_never_split(tokenizer):
    text = " Grüße aus Köln: 東京タワー 🎉🚀 naïve café — ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # The test must bite: some token prefix ends inside a character.
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    deltas, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_across_tokens_is_cut_and_never_leaked(tokenizer):
    text = " The answer is forty-two. END OF TEXT and more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas, detok = stream(tokenizer, ids, stop=["END OF"])
    assert detok.stopped
    assert "".join(deltas) == " The answer is forty-two. "
    assert all("END" not in d for d in deltas)
