"""Requests that cannot fit, one rule for all of them: at start-up one sequence of ``max_model_len``
tokens must fit the KV pool (a given ``--max-model-len`` that does not is an error naming both
numbers and the flags; the model's own limit is lowered with a warning), and a request whose
prompt plus ``max_tokens`` exceeds the context is refused at once (OpenAI's 400
``context_length_exceeded`` at the front, INVALID_ARGUMENT on gRPC), never left waiting."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.engine import EngineCore
from shardserve.cluster.frontend.openai_protocol import engine_rejected
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.engine.scheduler import SchedulerConfig

BLOCK, BLOCKS = 16, 6   # a 96-token pool


def test_a_max_model_len_the_kv_pool_cannot_hold_fails_at_start_up():
    with pytest.raises(ValueError) as err:
        EngineArgs(block_size=BLOCK, kv_cache_gib=0.01, max_model_len=200).fit_max_model_len(8192, BLOCKS)
    message = str(err.value)
    for part in ("--max-model-len 200", "needs 13 blocks", "6 blocks of 16 tokens (96 tokens)",
                 "--kv-cache-gib (now 0.01)", "at most 96"):
        assert part in message, message
    assert EngineArgs(block_size=BLOCK, max_model_len=96).fit_max_model_len(8192, BLOCKS) == 96


def test_a_max_model_len_above_the_models_context_is_refused():
    """Positions past ``max_position_embeddings`` have no RoPE rotation: vLLM refuses the setting too."""
    config = SimpleNamespace(max_position_embeddings=8192)
    with pytest.raises(ValueError, match=r"--max-model-len 8193 is more than this model's context length, 8192 "
                                         r"tokens \(max_position_embeddings in its config\); lower --max-model-len "
                                         r"to at most 8192"):
        EngineArgs(max_model_len=8193).check_model_limits(config)
    EngineArgs(max_model_len=8192).check_model_limits(config)
    EngineArgs().check_model_limits(config)


@pytest.mark.parametrize("setting,flag", [({"dsa": True}, "--dsa"), ({"dsa_top_k": 8}, "--dsa-top-k"),
                                          ({"dsa_sink": 1}, "--dsa-sink"),
                                          ({"indexer_cache_dtype": "fp8"}, "--indexer-cache-dtype fp8")])
def test_dsa_settings_on_a_model_without_an_indexer_are_refused(setting, flag):
    """They did nothing there; ``--no-dsa`` (dense attention, what such a model runs) stays allowed."""
    llama = SimpleNamespace(max_position_embeddings=8192, model_type="llama")
    with pytest.raises(ValueError, match=f"^{flag}: this model has no DSA indexer .* llama does not"):
        EngineArgs(**setting).check_model_limits(llama)
    EngineArgs(dsa=False).check_model_limits(llama)
    EngineArgs(**setting).check_model_limits(SimpleNamespace(max_position_embeddings=8192, index_topk=64))


def test_without_max_model_len_the_limit_is_lowered_to_the_pool_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="shardserve.cluster.config"):
        assert EngineArgs(block_size=BLOCK).fit_max_model_len(8192, BLOCKS) == 96
        assert EngineArgs(block_size=BLOCK).fit_max_model_len(64, BLOCKS) == 64   # fits: kept, no warning
    (record,) = caplog.records
    assert "lowered from 8192 (the model's) to 96 tokens" in record.getMessage()


def test_prompt_plus_max_tokens_over_the_context_is_refused_at_once():
    core = EngineCore(None, None, BLOCKS, BLOCK, SchedulerConfig(max_model_len=64), set(), vocab_size=1000)
    prompt = list(range(3, 63))                                    # 60 tokens
    with pytest.raises(ValueError) as err:
        core.add_request(prompt, SamplingParams(max_tokens=5))     # 65 > 64
    assert not core.has_unfinished() and core.block_manager.num_free_blocks == BLOCKS
    front = engine_rejected(str(err.value), "prompt")
    assert (front.status, front.code, front.param) == (400, "context_length_exceeded", "max_tokens")
    assert "context length is 64 tokens" in front.message and "max_tokens <= 4" in front.message
    renamed = engine_rejected(str(err.value), "messages", max_tokens_param="max_completion_tokens")
    assert renamed.param == "max_completion_tokens" and "max_completion_tokens <= 4" in renamed.message
    assert "max_tokens" not in renamed.message
    core.validate(prompt, SamplingParams(max_tokens=4))            # exactly the context: accepted
    core.validate(prompt, SamplingParams(max_tokens=None))         # up to the context: accepted
