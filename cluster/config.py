"""Engine arguments shared by the CLI, the single-process engine and the cluster."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from shardserve.cluster.dp_attention_args import check_dp_attention_args, check_dp_attention_model
from shardserve.workers.compilation import COMPILE_MODES
from shardserve.workers.device import DEVICES, DTYPES, check_utilization
from shardserve.workers.model_source import DEFAULT_MODEL, is_gguf_model
from shardserve.workers.quantization import check_packed_dense_rows

QUANTIZATION_CHOICES = ("none", "int8", "int4")
SPECULATIVE_POLICIES = ("adaptive", "fixed")   # cluster/engine/spec_policy.py
# Default prompt-token budget of one step on CPU ranks (issue 30): a prompt token costs about as
# much as a decoding sequence there (2-core machine, SmolLM2-135M Q4_1: ~2-4 ms each), so a burst
# of 32 prompts admitted at once made one multi-second step that every one of them waited for.
CPU_MAX_PREFILL_TOKENS = 128
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineArgs:
    """Everything needed to build an engine for one model replica.

    Attributes:
        model: known model name, ``.gguf`` file, or HF checkpoint folder.
        block_size: tokens per KV block.
        kv_cache_gib: KV cache budget per rank, GiB (ignored when ``num_blocks`` is set).
        num_blocks: exact KV blocks per rank.
        max_num_seqs / max_num_batched_tokens: per-step limits of the scheduler.
        max_prefill_tokens: prompt tokens (prefills and prefill chunks) one step computes at most;
            None: :data:`CPU_MAX_PREFILL_TOKENS` on CPU ranks, only ``max_num_batched_tokens`` on GPUs
            (:meth:`prefill_budget`).
        max_model_len: context length cap (default: the model's).
        enable_prefix_caching: reuse KV blocks of equal prompt prefixes.
        seed: seed of the generator used by unseeded sampled requests.
        tensor_parallel_size / tensor_split: TP ranks and their relative shares (uneven splits).
        dsa: DSA sparse attention on/off for DeepSeek-V3.2 / GLM-5 (None = on when the checkpoint
            has an indexer; off = dense MLA).
        dsa_top_k: keys each query attends to under DSA (None = the checkpoint's ``index_topk``).
        indexer_cache_dtype: DSA indexer-key cache format: ``"auto"`` (the model dtype) or ``"fp8"``
            (DeepSeek-V3.2's e4m3 keys + one power-of-two scale per 128 dims; queries quantized alike).
        dsa_sink: the first N positions of each sequence are always in its queries' DSA top-k
            (attention sink; 0 = plain top-k, equal to transformers).
        speculative_tokens: MTP draft tokens per decoding sequence and step (1..4; 0 = off): the
            most the policy drafts.
        speculative_policy: ``adaptive`` (draft only when, and as deep as, it pays: measured step
            costs and per-request acceptance, ``cluster/engine/spec_policy.py``) or ``fixed``
            (always ``speculative_tokens``).
        device: where each rank computes: ``auto`` (``cuda`` when the rank has a GPU, else ``cpu``),
            ``cuda`` or ``cpu`` (``workers/device.py``).
        dtype: weights and activations: ``auto`` (bfloat16 on CUDA; on CPU bfloat16 with packed
            weights for a GGUF file of mostly Q4_0/Q4_1/Q8_0 matrices, else float32), ``bfloat16``,
            ``float16`` or ``float32`` (on CPU the exact dequantized path).
        quantization: ``none`` / ``int8`` / ``int4``: weight-only quantization of a float checkpoint
            at load time for the CPU kernels (int8 per output row, int4 per group of 32).
        gpu_memory_utilization: fraction of each GPU a rank may use for weights, activations and
            caches, ``(0, 1]``; the KV cache takes what is left (CPU ranks use ``kv_cache_gib``).
        enforce_eager: run decode steps eagerly on CUDA (no captured CUDA graphs).
        compile: ``off``, ``auto`` (where it was measured to pay: CPU ranks) or ``on``: the forward
            through ``torch.compile``, kernels cached under ``$SHARDSERVE_CACHE`` (``workers/compilation.py``).
        packed_dense_rows: CPU packed weights also keep a dense copy for matmuls of at least this many
            input rows: an integer as text, ``0`` = none (the default: the copies roughly quadruple a Q4
            model's weight memory), or ``auto`` (16 where that pays on this CPU and fits in memory,
            ``workers.quantization.weight_format_for``; ``kernels/packed_linear.py``).
        enable_dp_attention: data-parallel attention inside the replica (SGLang's name; issue 29): the
            ``tensor_parallel_size`` ranks form ``attention_dp_size`` attention groups, each running MLA and
            the DSA indexer over its own requests with its own KV and indexer caches, while the MoE experts
            are partitioned over all ranks (expert parallel). MLA + MoE models only.
        attention_dp_size: attention groups ``D`` (divides ``tensor_parallel_size``; each group is
            ``tensor_parallel_size / D`` tensor-parallel ranks); None = ``tensor_parallel_size``.
        moe_a2a: how MoE layers exchange tokens between attention groups under DP attention:
            ``allgather`` (all-gather the step's hidden states, reduce-scatter the outputs) or
            ``alltoall`` (each token goes only to the ranks holding its chosen experts).
        recovery_timeout: seconds a replica may take to repair a dead shard / draft worker in place
            (new actors in the same bundles; 0 = no in-place repair: the replica fails and Serve
            replaces it).
    """

    model: str = DEFAULT_MODEL
    block_size: int = 16
    kv_cache_gib: float = 1.0
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    tensor_split: list[float] | None = None
    dsa: bool | None = None
    dsa_top_k: int | None = None
    indexer_cache_dtype: str = "auto"
    dsa_sink: int = 0
    speculative_tokens: int = 0
    speculative_policy: str = "adaptive"
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    recovery_timeout: float = 300.0
    quantization: str = "none"
    compile: str = "off"
    packed_dense_rows: str = "0"
    enable_dp_attention: bool = False
    attention_dp_size: int | None = None
    moe_a2a: str = "allgather"

    def validate(self) -> None:
        """Raises ValueError for inconsistent settings (``--quantization`` with a GGUF model among
        them: its weights are quantized already; the DP-attention flags:
        :func:`cluster.dp_attention_args.check_dp_attention_args`). Reads no model file."""
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.num_blocks is None and not 0 < self.kv_cache_gib < math.inf:
            raise ValueError(f"--kv-cache-gib must be > 0 (and finite), got {self.kv_cache_gib}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_split is not None and len(self.tensor_split) != self.tensor_parallel_size:
            raise ValueError(f"--tensor-split {self.tensor_split} needs {self.tensor_parallel_size} entries")
        if self.dsa_top_k is not None and self.dsa_top_k < 1:
            raise ValueError(f"--dsa-top-k must be >= 1, got {self.dsa_top_k}")
        if self.dsa_sink < 0 or (self.dsa_top_k is not None and self.dsa_sink > self.dsa_top_k):
            raise ValueError(f"--dsa-sink must be in 0..--dsa-top-k, got {self.dsa_sink}")
        if self.indexer_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"--indexer-cache-dtype must be 'auto' or 'fp8', got {self.indexer_cache_dtype!r}")
        if not 0 <= self.speculative_tokens <= 4:
            raise ValueError(f"--speculative-tokens must be in 0..4 (0 = off), got {self.speculative_tokens}")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"--speculative-policy must be one of {', '.join(SPECULATIVE_POLICIES)}, "
                             f"got {self.speculative_policy!r}")
        if not self.recovery_timeout >= 0:
            raise ValueError(f"--recovery-timeout must be >= 0 seconds (0 = off), got {self.recovery_timeout}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        check_utilization(self.gpu_memory_utilization)
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        rows = check_packed_dense_rows(str(self.packed_dense_rows))
        if rows != "auto" and int(rows) > self.max_num_batched_tokens:
            raise ValueError(f"--packed-dense-rows {rows} exceeds --max-num-batched-tokens {self.max_num_batched_tokens}: "
                             "no step has that many rows, so the dense copies would never be used (0 keeps none)")
        if self.quantization != "none" and is_gguf_model(self.model):
            raise ValueError(f"--quantization {self.quantization} applies to float checkpoints; "
                             f"{self.model} is a GGUF file, quantized already")
        check_dp_attention_args(self)   # --enable-dp-attention / --attention-dp-size / --moe-a2a

    def runner_config(self):
        """The ranks' :class:`workers.model_runner.RunnerConfig` (``auto`` device and dtype are
        resolved on each rank)."""
        from shardserve.workers.model_runner import RunnerConfig

        return RunnerConfig(block_size=self.block_size, kv_cache_bytes=int(self.kv_cache_gib * 2**30),
                            num_blocks=self.num_blocks, tensor_split=self.tensor_split, device=self.device,
                            dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization,
                            enforce_eager=self.enforce_eager, max_num_seqs=self.group_budgets[0],
                            max_num_batched_tokens=self.group_budgets[1], max_model_len=self.max_model_len,
                            seed=self.seed, quantization=self.quantization, compile=self.compile,
                            packed_dense_rows=str(self.packed_dense_rows), attention_dp_size=self.attention_groups,
                            moe_a2a=self.moe_a2a)

    @property
    def attention_groups(self) -> int:
        """Attention groups ``D`` of the replica: 1 without ``enable_dp_attention`` (plain TP), else
        ``attention_dp_size`` (default: every rank its own group, ``tensor_parallel_size``)."""
        if not self.enable_dp_attention:
            return 1
        return self.attention_dp_size or self.tensor_parallel_size

    @property
    def group_budgets(self) -> tuple[int, int]:
        """``(max_num_seqs, max_num_batched_tokens)`` of one attention group's step: the replica's
        limits divided by the ``D`` groups under data-parallel attention (SGLang divides
        ``chunked_prefill_size`` and ``max_running_requests`` by the DP size), so one step of every
        group together stays within the replica's budget; the limits themselves under plain TP.
        :func:`cluster.dp_attention_args.check_dp_attention_args` refuses a budget below one per group."""
        groups = self.attention_groups
        return self.max_num_seqs // groups, self.max_num_batched_tokens // groups

    def prefill_budget(self, on_cpu: bool) -> int | None:
        """Prompt tokens one step computes at most (``SchedulerConfig.max_prefill_tokens``): the
        setting, else :data:`CPU_MAX_PREFILL_TOKENS` when the ranks compute on CPU, else None (only
        the step budget bounds them)."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return CPU_MAX_PREFILL_TOKENS if on_cpu else None

    def draft_buffer_sizes(self):
        """What the buffers rank 0 shares with the MTP draft worker must hold
        (:class:`workers.draft_buffers.BufferSizes`)."""
        from shardserve.workers.draft_buffers import BufferSizes

        return BufferSizes(self.max_num_batched_tokens, self.max_num_seqs, self.speculative_tokens)

    def check_model_limits(self, hf_config) -> None:
        """Refuse settings the model itself cannot serve (checked once its config is read, before
        any weight is loaded).

        Raises:
            ValueError: ``max_model_len`` is more than the model's context length
                (``max_position_embeddings``: the length of its RoPE table; positions past it have no
                rotation), as vLLM refuses it; ``enable_dp_attention`` on a model without MLA or
                without MoE (:func:`cluster.dp_attention_args.check_dp_attention_model`); a DSA
                setting (``--dsa``, ``--dsa-top-k``, ``--dsa-sink``, ``--indexer-cache-dtype fp8``)
                on a model without DSA's indexer (no ``index_topk`` in its config), which would
                ignore it (``--no-dsa`` stays allowed: dense attention is what such a model runs).
        """
        from shardserve.workers.model_source import model_context_length

        limit = model_context_length(hf_config)
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(f"--max-model-len {self.max_model_len} is more than this model's context length, "
                             f"{limit} tokens (max_position_embeddings in its config); lower --max-model-len to at "
                             f"most {limit}")
        check_dp_attention_model(self, hf_config)
        asked = [flag for flag, on in (("--dsa", self.dsa is True), ("--dsa-top-k", self.dsa_top_k is not None),
                                       ("--dsa-sink", self.dsa_sink > 0),
                                       ("--indexer-cache-dtype fp8", self.indexer_cache_dtype == "fp8")) if on]
        if asked and not hasattr(hf_config, "index_topk"):
            raise ValueError(f"{', '.join(asked)}: this model has no DSA indexer (DeepSeek-V3.2 / GLM-5 have one; "
                             f"{getattr(hf_config, 'model_type', 'this one')} does not), so the setting would do "
                             "nothing")

    def fit_max_model_len(self, model_max_len: int, num_blocks: int) -> int:
        """The context length to serve: one sequence of that length must fit the KV pool
        (``num_blocks * block_size`` tokens per rank), as vLLM requires at start-up.

        Args:
            model_max_len: the model's own limit (``max_position_embeddings``).
            num_blocks: KV blocks every rank holds.

        Returns:
            ``max_model_len`` when given and it fits; else the model's limit, lowered to what the
            pool holds (with a warning).

        Raises:
            ValueError: ``max_model_len`` was given and is more than the pool holds (the message
                names both numbers and the flags to change).
        """
        pool_tokens = num_blocks * self.block_size
        if self.max_model_len is not None:
            if self.max_model_len > pool_tokens:
                raise ValueError(
                    f"--max-model-len {self.max_model_len} does not fit the KV cache: one sequence of "
                    f"{self.max_model_len} tokens needs {-(-self.max_model_len // self.block_size)} blocks, the "
                    f"pool holds {num_blocks} blocks of {self.block_size} tokens ({pool_tokens} tokens) per rank; "
                    f"raise --kv-cache-gib (now {self.kv_cache_gib:g}) or lower --max-model-len to at most "
                    f"{pool_tokens}")
            return self.max_model_len
        if model_max_len > pool_tokens:
            logger.warning("max_model_len lowered from %d (the model's) to %d tokens, what the KV cache holds "
                           "(%d blocks of %d tokens); raise --kv-cache-gib (now %g) for longer contexts",
                           model_max_len, pool_tokens, num_blocks, self.block_size, self.kv_cache_gib)
            return pool_tokens
        return model_max_len

    def model_config(self, hf_config):
        """``hf_config`` with this engine's model switches applied (read by the model classes)."""
        if self.dsa is not None:
            hf_config.shardserve_dsa = self.dsa
        if self.dsa_top_k is not None:
            hf_config.shardserve_dsa_top_k = self.dsa_top_k
        hf_config.shardserve_indexer_cache_dtype = self.indexer_cache_dtype
        hf_config.shardserve_dsa_sink = self.dsa_sink
        return hf_config
