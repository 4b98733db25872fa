"""Data-parallel attention's surface (issue 29) without Ray or weights: ``EngineArgs.validate`` and
``ServeArgs`` (``serve_config.yaml`` keys) refuse inconsistent flags, the model check refuses models
without MLA or MoE (from ``config.json`` or a GGUF header), the flags reach the RayService that
``shardserve manifest`` writes, and the console script says each class of error in one line, exit
code 2, before anything loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import DeepseekV3Config, LlamaConfig, Qwen3NextConfig

from shardserve.cluster import cli
from shardserve.cluster.config import EngineArgs
from shardserve.cluster.dp_attention_args import check_dp_attention_start
from shardserve.cluster.serve_app import ServeArgs

TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "vocab_size": 256}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """Folders holding only a ``config.json``: DeepSeek-V3 (MLA + MoE), Llama (neither), Qwen3-Next
    (MoE without MLA)."""
    root = tmp_path_factory.mktemp("dp-configs")
    made = {"deepseek": DeepseekV3Config(**TINY, moe_intermediate_size=32, n_routed_experts=4, kv_lora_rank=16,
                                         q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
            "llama": LlamaConfig(**TINY),
            "qwen3-next": Qwen3NextConfig(**TINY, num_experts=4, moe_intermediate_size=32)}
    for name, config in made.items():
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        config.save_pretrained(root / name)
    return {name: root / name for name in made}


@pytest.mark.parametrize("fields, message", [
    ({"attention_dp_size": 2}, "--attention-dp-size 2 needs --enable-dp-attention"),
    ({"moe_a2a": "alltoall"}, "--moe-a2a alltoall needs --enable-dp-attention"),
    ({"enable_dp_attention": True, "moe_a2a": "deepep"}, "--moe-a2a must be one of allgather, alltoall"),
    ({"enable_dp_attention": True, "attention_dp_size": 3}, "--attention-dp-size 3 must be >= 1 and divide "
                                                              "--tensor-parallel-size 4 (each attention group is "
                                                              "tensor-parallel-size / D ranks; try one of 1, 2, 4)"),
    ({"enable_dp_attention": True, "attention_dp_size": 0}, "--attention-dp-size 0 must be >= 1"),
    ({"enable_dp_attention": True, "tensor_split": [2, 1, 1, 1]}, "--tensor-split 2,1,1,1 is uneven"),
    ({"enable_dp_attention": True, "max_num_batched_tokens": 3}, "--max-num-batched-tokens 3 is the replica's step "
                                                                  "budget, split over its 4 attention groups"),
    ({"enable_dp_attention": True, "speculative_tokens": 1}, "--speculative-tokens with --enable-dp-attention is "
                                                             "not supported yet"),
])
def test_inconsistent_flags_are_refused_by_engine_and_serve_args(fields, message):
    with pytest.raises(ValueError) as exc:
        EngineArgs(tensor_parallel_size=4, **fields).validate()
    assert message in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match=message.split(" (")[0].replace("-", "\\-")):   # serve_config.yaml args
        ServeArgs.from_dict({"tensor_parallel_size": 4, **fields})


def test_consistent_flags_pass_and_resolve_the_groups():
    assert EngineArgs(tensor_parallel_size=4).attention_groups == 1
    for fields, groups in (({}, 4), ({"attention_dp_size": 2}, 2), ({"tensor_split": [1, 1, 1, 1]}, 4),
                           ({"attention_dp_size": 1, "moe_a2a": "alltoall"}, 1)):
        args = EngineArgs(tensor_parallel_size=4, enable_dp_attention=True, **fields)
        args.validate()
        assert args.attention_groups == groups
    # the step budget is the replica's: each group's runner (and scheduler, test_dp_engine.py) gets 1/D
    dp = EngineArgs(tensor_parallel_size=4, enable_dp_attention=True, attention_dp_size=2, max_num_seqs=9,
                    max_num_batched_tokens=2049).runner_config()
    plain = EngineArgs(tensor_parallel_size=4, max_num_seqs=9, max_num_batched_tokens=2049).runner_config()
    assert (dp.max_num_seqs, dp.max_num_batched_tokens, plain.max_num_seqs, plain.max_num_batched_tokens) == \
        (4, 1024, 9, 2049)
    serve = ServeArgs.from_dict({"tensor_parallel_size": 4, "enable_dp_attention": True, "moe_a2a": "alltoall"})
    engine = serve.engine_args()
    assert (engine.enable_dp_attention, engine.attention_dp_size, engine.moe_a2a) == (True, None, "alltoall")


def test_models_without_mla_or_moe_are_refused_from_their_config(configs, smollm2_files):
    """The check reads config.json (transformers' AutoConfig) or the GGUF header, never weights; the
    same rule runs in ``check_model_limits`` (the engines, ``plan``)."""
    for name, missing in (("llama", "no MoE layers and no MLA attention"), ("qwen3-next", "no MLA attention"),
                          (str(smollm2_files.path), "(llama (GGUF)) has no MoE layers and no MLA attention")):
        model = str(configs[name]) if name in configs else name
        args = EngineArgs(model=model, tensor_parallel_size=2, enable_dp_attention=True)
        with pytest.raises(ValueError) as exc:
            check_dp_attention_start(args)
        text = str(exc.value)
        assert missing in text and "MLA + MoE models (DeepSeek-V3 / V3.2, GLM-5 style)" in text and "\n" not in text
    good = EngineArgs(model=str(configs["deepseek"]), tensor_parallel_size=2, enable_dp_attention=True)
    check_dp_attention_start(good)
    check_dp_attention_start(EngineArgs(model=str(configs["llama"]), tensor_parallel_size=2))   # off: no check


def test_manifest_passes_the_flags_to_the_rayservice(capsys):
    assert cli.main(["manifest", "-tp", "8", "--gpus-per-worker", "1", "--api-key-secret", "k",
                     "--enable-dp-attention", "--attention-dp-size", "4", "--moe-a2a", "alltoall"]) == 0
    docs = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    (service,) = [doc for doc in docs if doc["kind"] == "RayService"]
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert {key: app["args"][key] for key in ("enable_dp_attention", "attention_dp_size", "moe_a2a")} == {
        "enable_dp_attention": True, "attention_dp_size": 4, "moe_a2a": "alltoall"}
    assert cli.main(["manifest", "-tp", "8", "--api-key-secret", "k", "--enable-dp-attention",
                     "--attention-dp-size", "3"]) == 2
    assert "--attention-dp-size 3 must be >= 1 and divide" in capsys.readouterr().err


@pytest.mark.slow
def test_each_class_of_bad_input_is_one_line_and_exit_2_from_the_console_script(configs, smollm2_files):
    """The installed ``shardserve`` as a user runs it (the three at once; an unknown ``--moe-a2a`` is
    argparse's choices, checked in-process below)."""
    exe = str(Path(sys.executable).parent / "shardserve")
    cases = {
        "model": (["generate", "--prompt", "hi", "-tp", "2", "--model", str(smollm2_files.path),
                   "--enable-dp-attention"],
                  "this model (llama (GGUF)) has no MoE layers and no MLA attention; data-parallel attention is "
                  "for MLA + MoE models"),   # the GGUF header is read, not the weights
        "dp-size": (["serve-grpc", "--model", str(configs["deepseek"]), "-tp", "4", "--enable-dp-attention",
                     "--attention-dp-size", "3"], "--attention-dp-size 3 must be >= 1 and divide"),
        "split": (["generate", "--prompt", "hi", "--model", str(configs["deepseek"]), "-tp", "2",
                   "--tensor-split", "2,1", "--enable-dp-attention"],
                  "--tensor-split 2,1 is uneven: --enable-dp-attention needs equal ranks"),
    }
    procs = {name: subprocess.Popen([exe, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (argv, _) in cases.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", (name, out, err)
        assert err.count("\n") == 1 and cases[name][1] in err, (name, err)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--enable-dp-attention", "--moe-a2a", "deepep"], "argument --moe-a2a: invalid choice: 'deepep'"),
    (["plan", "--moe-a2a", "alltoall", "--device", "cpu"], "--moe-a2a alltoall needs --enable-dp-attention"),
    (["serve-grpc", "-tp", "2", "--enable-dp-attention", "--tensor-split", "3,1"], "--tensor-split 3,1 is uneven"),
])
def test_the_other_commands_refuse_alike_in_process(argv, message, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exc:   # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("command", ["serve", "serve-grpc", "plan"])
def test_serve_and_plan_refuse_a_model_without_moe_before_ray_starts(command, configs, capsys, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("Ray started before the model was checked")

    monkeypatch.setattr(cli, "init_ray", boom)
    argv = [command, "--model", str(configs["llama"]), "-tp", "2", "--enable-dp-attention"]
    assert cli.main(argv + (["--gpu-memory-gib", "80"] if command == "plan" else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(LlamaForCausalLM) has no MoE layers and no MLA attention" in err, err
