"""``shardserve plan`` at full size (no GPU, no weights): the released DeepSeek-V3.2 FP8 config
(transformers' default ``DeepseekV32Config()``) planned for 8 x 141 GiB (fits) and 4 x 80 GiB (does
not), its per-rank weight bytes checked against arithmetic written out here from the config; the
plan's memory rule on made-up numbers; and bad input, one line and exit code 2.

The CLI runs in this process (``cli.main``): the same parser, the same exit codes as the console
script, without a second interpreter's start-up.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from transformers import DeepseekV32Config

from shardserve.cluster.cli import main
from shardserve.workers.plan import PlanConfig, RankPlan, check_plan

GIB = 2**30
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def v32_fp8(tmp_path_factory):
    """A folder holding only the config.json of DeepSeek-V3.2 (FP8, as released)."""
    folder = tmp_path_factory.mktemp("deepseek-v3.2")
    config = DeepseekV32Config()
    config.architectures = ["DeepseekV32ForCausalLM"]
    config.quantization_config = FP8
    config.save_pretrained(folder)
    return folder


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def fp8_bytes(rows: int, cols: int) -> int:
    """A block-FP8 weight: 1 byte per element, a float32 scale per 128 x 128 block."""
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * 4


def v32_rank_weight_bytes(tp: int, routed: bool = True, attention_tp: int | None = None) -> int:
    """One rank's weights of DeepSeek-V3.2 FP8 at an even split of ``tp`` ranks, from the config's
    numbers: FP8 linear layers (attention, dense MLPs, routed and shared experts, the indexer's
    wq_b / wk) with their scales; bf16 embeddings, LM head, norms and kv_b_proj (absorbed decode
    reads it, so it is dequantized); float32 router and indexer head weights (as transformers and
    DeepSeek's inference code keep them). ``routed=False``: without the routed experts;
    ``attention_tp``: the heads split over that many ranks instead (DP attention's group size)."""
    hidden, layers, vocab, heads = 7168, 61, 129280, 128 // (attention_tp or tp)
    q_lora, kv_lora, rope, nope, v_dim = 1536, 512, 64, 128, 128
    dense_layers, inter, moe_inter, experts = 3, 18432 // tp, 2048, 256 // tp
    index_heads, index_dim, shared = 64, 128, 2048 // tp
    bf16, f32 = 2, 4
    attention = (fp8_bytes(q_lora, hidden) + q_lora * bf16 + fp8_bytes(heads * (nope + rope), q_lora)
                 + fp8_bytes(kv_lora + rope, hidden) + kv_lora * bf16 + heads * (nope + v_dim) * kv_lora * bf16
                 + fp8_bytes(hidden, heads * v_dim)
                 + fp8_bytes(index_heads * index_dim, q_lora) + fp8_bytes(index_dim, hidden) + 2 * index_dim * bf16
                 + index_heads * hidden * f32 + 2 * hidden * bf16)
    dense = fp8_bytes(2 * inter, hidden) + fp8_bytes(hidden, inter)
    experts *= routed
    moe = (256 * hidden * f32 + 256 * f32
           + experts * (2 * moe_inter * hidden + (2 * moe_inter // 128) * (hidden // 128) * 4)
           + experts * (hidden * moe_inter + (hidden // 128) * (moe_inter // 128) * 4)
           + fp8_bytes(2 * shared, hidden) + fp8_bytes(hidden, shared))
    return (layers * attention + dense_layers * dense + (layers - dense_layers) * moe
            + 2 * (vocab // tp) * hidden * bf16 + hidden * bf16)


def test_deepseek_v32_fp8_fits_eight_h200s_not_four_80gib_gpus(v32_fp8, capsys):
    code, out, err = run(capsys, v32_fp8, "-tp", 8, "--gpu-memory-gib", 141, "--max-model-len", 32768, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is True and len(plan["ranks"]) == 8
    expected = v32_rank_weight_bytes(8)
    for rank in plan["ranks"]:
        assert rank["weight_bytes"] == expected, (rank["rank"], rank["weight_bytes"] - expected)
        assert rank["device_bytes"] == 141 * GIB and rank["fits"] is True
        assert rank["kv_bytes_per_token"] == 61 * (512 + 64) * 2 + 61 * 128 * 2   # latent + indexer keys, bf16
        assert rank["kv_tokens"] >= 32768 and rank["weight_bytes_by_dtype"]["float8_e4m3fn"] > 70 * GIB
    assert plan["kv_tokens"] == min(r["kv_tokens"] for r in plan["ranks"])

    code, out, err = run(capsys, v32_fp8, "-tp", 4, "--gpu-memory-gib", 80, "--json")
    plan = json.loads(out)
    assert code == 2 and plan["fits"] is False and len(plan["ranks"]) == 4
    assert all(rank["weight_bytes"] == v32_rank_weight_bytes(4) and not rank["fits"] for rank in plan["ranks"])
    held = v32_rank_weight_bytes(4) + 2 * 163840 * 32 * 4   # + the RoPE cos / sin tables
    assert err.count("\n") == 1 and f"its weights need {held / GIB:.2f} GiB, more than --gpu-memory-utilization " \
        "0.9 x 80.00 GiB = 72.00 GiB" in err


def test_memory_rule_arithmetic():
    """KV budget = utilization x device - weights - reserves; blocks less the scratch block; the
    one-line reasons name the numbers."""
    config = PlanConfig(device="cuda", device_bytes=80 * GIB, gpu_memory_utilization=0.9, block_size=16,
                        max_model_len=4096)

    def plan(weights: int, activation: int = 4 * GIB) -> RankPlan:
        return RankPlan(0, "cuda", 80 * GIB, int(0.9 * 80 * GIB), {"bfloat16": weights}, 0, 0, 1024, 0, 0, 0,
                        activation, GIB, GIB, 16, 4096, 1).solve(config)

    fits = plan(16 * GIB)
    assert fits.kv_budget_bytes == int(0.9 * 80 * GIB) - 22 * GIB
    assert fits.kv_blocks == fits.kv_budget_bytes // (1024 * 16) - 1 and fits.fits and fits.starts
    assert fits.max_concurrent_seqs == fits.kv_blocks // 256
    heavy = plan(70 * GIB)
    assert not heavy.starts and "leaves -4.00 GiB, less than one KV block" in heavy.reason
    with pytest.raises(ValueError, match="its weights need 100.00 GiB, more than --gpu-memory-utilization 0.9"):
        check_plan(plan(100 * GIB))
    short = plan(16 * GIB, activation=54 * GIB - 1024 * 16 * 100)   # a budget of 100 blocks (99 + scratch)
    assert short.starts and not short.fits and short.kv_blocks == 99
    assert "holds 1584 tokens (99 blocks of 16), less than one sequence of --max-model-len 4096" in short.reason


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib: must be > 0 GiB, got 0"),
    (["--gpu-memory-gib", "-8"], "--gpu-memory-gib: must be > 0 GiB, got -8"),
])
def test_bad_numbers_are_one_line(v32_fp8, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(v32_fp8), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


def test_bad_models_are_one_line(tmp_path, v32_fp8, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, tmp_path / "empty", "--gpu-memory-gib", 80)
    assert code == 2 and err.count("\n") == 1 and "no config.json" in err
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    config = json.loads((v32_fp8 / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["MysteryForCausalLM"]}))
    code, _, err = run(capsys, unknown, "--gpu-memory-gib", 80)
    assert code == 2 and err.count("\n") == 1 and "unsupported architecture ['MysteryForCausalLM']" in err
    code, _, err = run(capsys, v32_fp8, "-tp", 256, "--gpu-memory-gib", 80)   # 128 heads over 256 ranks
    assert code == 2 and err.count("\n") == 1 and "cannot split the model's 128 attention heads over 256 ranks" in err
    code, out, err = run(capsys, v32_fp8, "-tp", 3, "--gpu-memory-gib", 141, "--max-model-len", 8192, "--json")
    ranks = json.loads(out)["ranks"]   # uneven splits are allowed where serve allows them: 43 / 42 / 43 heads
    assert code == 2 and len(ranks) == 3 and ranks[0]["weight_bytes"] != ranks[1]["weight_bytes"]
    code, _, err = run(capsys, v32_fp8, "--gpu-memory-gib", 80, "--max-model-len", 10**6)
    assert code == 2 and "more than this model's context length, 163840" in err


def test_dp_attention_plan_of_deepseek_v32_fp8_on_eight_h200s(v32_fp8, capsys):
    """Issue 29: with ``--enable-dp-attention`` (8 groups of 1 rank) each rank holds all attention
    heads (MLA + indexer) and 1/8 of everything else (routed and shared experts, dense MLPs,
    embedding, LM head: SGLang's layout), each group steps over 1/8 of the replica's
    ``--max-num-batched-tokens``, and the replica's KV capacity is 8 pools: at least 6x plain
    TP=8's at the default settings (6.32x at --max-model-len 32768). The per-rank weights are
    checked against the config's arithmetic; both KV figures are printed."""
    argv = [v32_fp8, "-tp", 8, "--gpu-memory-gib", 141, "--max-model-len", 32768, "--enable-dp-attention"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("KV cache per replica")]
    groups, tokens, plain, ratio = re.fullmatch(r"KV cache per replica: (\d) group\(s\) x \d+ blocks x 16 = (\d+) "
                                                r"tokens; plain TP=8: (\d+) tokens \((\S+)x\)", line).groups()
    assert groups == "8" and int(tokens) / int(plain) == pytest.approx(float(ratio), abs=0.01)
    assert int(tokens) >= 6 * int(plain), line

    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    info, ranks = plan["dp_attention"], plan["ranks"]
    routed = v32_rank_weight_bytes(8) - v32_rank_weight_bytes(8, routed=False)
    for rank in ranks:
        assert rank["weight_bytes"] == v32_rank_weight_bytes(8, attention_tp=1), rank["rank"]
        assert rank["graph_bytes"] == 0 and rank["fits"]   # eager decode under DP attention
    assert info["routed_expert_bytes"] == [routed] * 8
    assert info["plain_tp_weight_bytes"] == [v32_rank_weight_bytes(8)] * 8
    assert info["group_max_num_batched_tokens"] == 2048 // 8 and info["group_max_num_seqs"] == 64 // 8
    assert plan["attention_dp_size"] == 8 and plan["kv_tokens"] == 8 * ranks[0]["kv_tokens"] == int(tokens)
    with capsys.disabled():
        print(f"\nDeepSeek-V3.2 FP8, 8 x 141 GiB, --max-model-len 32768: KV tokens per replica TP=8 {plain}, "
              f"DP attention {tokens} ({ratio}x); per rank {ranks[0]['weight_bytes'] / GIB:.2f} GiB of weights "
              f"(TP=8: {info['plain_tp_weight_bytes'][0] / GIB:.2f} GiB)")


def test_device_auto_plans_for_the_cpu_where_no_gpu_is_visible(v32_fp8, capsys, monkeypatch):
    """A CPU-only machine plans for its own memory under ``--device auto`` (where ``serve`` would
    run); a GPU plan needs the GPU's size there, and ``--gpu-memory-gib`` chooses one."""
    import shardserve.workers.device as device

    monkeypatch.setattr(device, "visible_gpus", lambda: 0)
    tiny = ["--max-model-len", 4096, "--json"]
    code, out, err = run(capsys, v32_fp8, "-tp", 8, *tiny)
    plan = json.loads(out)   # 671B parameters do not fit in this machine's memory: exit code 2
    assert code == 2 and ", cpu" in plan["notes"][0] and not plan["fits"], err
    assert abs(plan["ranks"][0]["device_bytes"] - device.host_memory_available()) < GIB
    code, _, err = run(capsys, v32_fp8, "--device", "cuda", *tiny)
    assert code == 2 and err.count("\n") == 1 and "no GPU is visible here: give --gpu-memory-gib" in err
    code, out, err = run(capsys, v32_fp8, "-tp", 8, "--gpu-memory-gib", 141, *tiny)
    assert code == 0 and ", cuda" in json.loads(out)["notes"][0], err
