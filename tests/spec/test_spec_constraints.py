"""Structured outputs and sampling controls under MTP speculative decoding (single-process engine,
tiny DeepSeek-V3.2 / GLM-5 checkpoints with an MTP layer and the word-level test tokenizer):
greedy output with a grammar and penalties on equals plain decoding token for token, with the
real MTP's drafts and with an oracle whose drafts are right up to a chosen point (so the grammar
cuts drafts, verification rolls back and accepts partial runs); a preempted constrained request
resumes where it was; sampled constrained output always matches its grammar; every block and
every grammar matcher is released at the end."""

from __future__ import annotations

import gc
import re

import pytest

from shardserve.cluster.engine.grammar import num_live_grammars
from shardserve.cluster.engine.request import SamplingParams, StructuredOutputs
from spec_helpers import greedy, install_oracle, make_llm, prompts, record_preemptions
from tiny_checkpoints import tiny_token_text

REGEX = "(w01[0-9]|w02[0-9]|w1[0-2][0-9])+w05[0-9]"   # several tokens, then one that ends it
PREFIX = "(w01[0-9]|w02[0-9]|w1[0-2][0-9])*"            # what max_tokens may leave of it
CHOICE = ["w003w004w005", "w003w009", "w077"]
EOS = 1


def batch_params() -> list[SamplingParams]:
    """One request per kind of control, in the order of :func:`batch_prompts`."""
    return [
        greedy(12, structured_outputs=StructuredOutputs.regex(REGEX)),
        greedy(12, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={5: 3.0, 9: -50}),
        greedy(12, structured_outputs=StructuredOutputs.regex(REGEX), repetition_penalty=2.0, presence_penalty=-0.5,
               bad_words=["w017", "w021 w013"], min_tokens=3),
        greedy(12, structured_outputs=StructuredOutputs.choice(CHOICE)),
        greedy(12, frequency_penalty=2.0, min_tokens=6, allowed_token_ids=list(range(3, 40))),
    ]


def batch_prompts() -> list[list[int]]:
    return prompts() + prompts((6, 11), seed=3)


def text_of(token_ids: list[int]) -> str:
    return "".join(tiny_token_text(t) for t in token_ids if t != EOS)


def check_constraints(done, params) -> None:
    for d, p in zip(done, params):
        spec = p.structured_outputs
        if spec is not None and spec.kind == "regex":
            assert re.fullmatch(REGEX, text_of(d.token_ids)), d.token_ids
        if spec is not None and spec.kind == "choice":
            assert text_of(d.token_ids) in CHOICE and d.finish_reason == "stop"
        if p.allowed_token_ids:
            assert set(d.token_ids) <= set(p.allowed_token_ids)


def assert_released(llm) -> None:
    bm = llm.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    gc.collect()
    assert num_live_grammars() == 0


@pytest.fixture(scope="module")
def plain(mtp_checkpoint):
    """Plain decoding (speculation off) of the constrained batch, per architecture."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            done = make_llm(mtp_checkpoint(arch).path, 0).generate(batch_prompts(), batch_params())
            check_constraints(done, batch_params())
            cache[arch] = [d.token_ids for d in done]
        return cache[arch]

    return get


@pytest.mark.parametrize("arch,k", [("deepseek_v32", 1), ("deepseek_v32", 3), ("glm_moe_dsa", 2)])
def test_greedy_with_grammar_and_penalties_equals_plain_decoding(mtp_checkpoint, plain, arch, k):
    expected = plain(arch)
    llm = make_llm(mtp_checkpoint(arch).path, k)
    done = llm.generate(batch_prompts(), batch_params())
    assert [d.token_ids for d in done] == expected
    assert llm.core.speculator.stats.num_draft_tokens > 0
    assert_released(llm)


def test_oracle_drafts_partly_right_and_preemption(mtp_checkpoint, plain):
    """Drafts equal to the answer except every third output index (wrong there: often outside the
    grammar, so cut before verification, else rejected); a 9-block pool preempts requests; the
    adaptive policy picks the depths."""
    arch = "deepseek_v32"
    expected = plain(arch)
    truth = {tuple(p): ids + [EOS] * 8 for p, ids in zip(batch_prompts(), expected)}
    llm = make_llm(mtp_checkpoint(arch).path, 3, "adaptive", num_blocks=9)
    install_oracle(llm, truth, wrong=lambda index: index % 3 == 1)
    preempted = record_preemptions(llm)
    done = llm.generate(batch_prompts(), batch_params())
    assert [d.token_ids for d in done] == expected
    stats = llm.core.speculator.stats
    assert preempted and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_released(llm)


def test_sampled_constrained_output_matches_its_grammar(mtp_checkpoint):
    """Rejection sampling draws from the masked target: every sampled output is in the language."""
    llm = make_llm(mtp_checkpoint("glm_moe_dsa").path, 2)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, structured_outputs=StructuredOutputs.regex(REGEX),
                             presence_penalty=0.5) for s in range(4)] + \
             [SamplingParams(max_tokens=8, temperature=1.5, seed=9, structured_outputs=StructuredOutputs.choice(CHOICE))]
    done = llm.generate(prompts((5, 9, 4, 7, 6), seed=7), params)
    for d in done[:4]:
        if d.finish_reason == "stop":
            assert re.fullmatch(REGEX, text_of(d.token_ids)), d.token_ids
        else:   # cut by max_tokens: a prefix of a sentence of the language
            assert re.fullmatch(PREFIX, text_of(d.token_ids)), d.token_ids
    assert text_of(done[4].token_ids) in CHOICE
    assert_released(llm)


def test_cli_generate_with_a_constraint(mtp_checkpoint, capsys, tmp_path):
    """``shardserve generate --regex / --choice / --json-schema`` (with MTP speculation); bad
    constraints are one line on stderr and exit code 2."""
    from shardserve.cluster.cli import main

    argv = ["generate", "--model", str(mtp_checkpoint("glm_moe_dsa").path), "--prompt", "w005 w017 w033",
            "--max-tokens", "12", "--kv-cache-gib", "0.002", "--block-size", "4", "--speculative-tokens", "2"]
    assert main(argv + ["--regex", REGEX, "--presence-penalty", "0.5", "--logit-bias", "12=3"]) == 0
    # the whole language or, cut by --max-tokens, a prefix of a sentence of it
    assert re.fullmatch(f"({REGEX})|{PREFIX}", "".join(capsys.readouterr().out.split()))
    assert main(argv + ["--choice", "w077", "--choice", "w003w009"]) == 0
    assert "".join(capsys.readouterr().out.split()) in ("w077", "w003w009")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    not_compiling = tmp_path / "objekt.json"
    not_compiling.write_text('{"type": "objekt"}')
    for extra, fragment in ((["--json-schema", str(bad_json)], "is not valid JSON"),
                            (["--json-schema", str(tmp_path / "missing.json")], "cannot read it"),
                            (["--json-schema", str(not_compiling)], 'Unsupported type "objekt"'),
                            (["--logit-bias", "12"], "expected TOKEN_ID=VALUE"),
                            (["--logit-bias", "12=101"], "logit_bias values must be in [-100, 100]"),
                            (["--min-tokens", "13"], "min_tokens must be in [0, max_tokens (12)]")):
        assert main(argv + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("shardserve: error: ") and fragment in err, err
    with pytest.raises(SystemExit):   # one constraint at most
        main(argv + ["--regex", "a", "--choice", "b"])


def test_a_constraint_that_starts_after_a_marker_with_speculation(mtp_checkpoint):
    """``start_after`` (the end of thinking): the output runs free up to the marker, equal to
    unconstrained decoding, then follows the grammar; one- and two-token markers, the marker
    inside a step's drafts (k=3) or not (k=0) give the same tokens."""
    path = mtp_checkpoint("deepseek_v32").path
    ps = prompts((5, 9), seed=11)
    plain = make_llm(path, 0)
    free = [d.token_ids for d in plain.generate(ps, [greedy(6), greedy(6)])]
    markers = [(free[0][2],), (free[1][1], free[1][2])]
    params = [greedy(10, structured_outputs=StructuredOutputs(kind="regex", value=REGEX, start_after=m))
              for m in markers]
    runs = []
    for llm in (plain, make_llm(path, 3)):
        runs.append([d.token_ids for d in llm.generate(ps, params)])
        assert_released(llm)
    assert runs[0] == runs[1]
    for out, ref, marker in zip(runs[0], free, markers):
        n = len(marker)
        end = next(i for i in range(n - 1, len(ref)) if tuple(ref[i + 1 - n:i + 1]) == marker)
        assert out[:end + 1] == ref[:end + 1]
        assert re.fullmatch(f"({REGEX})|{PREFIX}", text_of(out[end + 1:])), out
