"""Frozen configuration of a model and of an engine, passed explicitly everywhere."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from common.settings import POSITIVE, POSITIVE_INT, Check, check_settings, setting

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
QUEUE_POLICIES = ("fcfs", "lpm", "priority")
DTYPES = ("bfloat16", "float32", "float16")  # what an engine computes in
AUTO_DTYPE = "auto"  # the dtype setting that lets the engine choose one of DTYPES per device
DTYPE_SETTINGS = (AUTO_DTYPE, *DTYPES)
ATTENTION_BACKENDS = ("auto", "sdpa", "flash")
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")  # what an engine runs on: cpu, cuda, cuda:N


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face configs describe it.

    `rope_type` is one of SUPPORTED_ROPE_TYPES; the other fields matter only to the
    types that use them (`factor` for linear and llama3, the rest for llama3).
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family checkpoint (Llama 2/3, Mistral, Qwen2/2.5/3)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    # Attention span of sliding-window models (Mistral v0.1). Baton attends over the whole
    # context, which equals sliding-window attention only up to this length, so the
    # engine caps max_model_len at it.
    sliding_window: int | None = None

    @property
    def context_limit(self) -> int:
        """The longest sequence this engine runs exactly for this model."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The engine settings an operator sets, each declared once: `ClusterConfig` inherits
    them as keys of the TOML file, BATON_* variables and `svc` flags, and a worker builds
    its engine from all of them. Values are checked on construction (ConfigError naming
    the key); what depends on the model or the machine is checked by the engine."""

    dtype: str = setting(AUTO_DTYPE, "dtype of the weights and the KV cache (auto: bfloat16 on GPUs and on CPUs "
                         "whose oneDNN computes bf16 natively, else float32)", choices=DTYPE_SETTINGS)
    device: str = setting("cpu", "cpu, cuda (worker N on GPU N modulo the GPUs it sees) or cuda:K",
                          check=Check(lambda value: bool(DEVICE_PATTERN.fullmatch(value)), "cpu, cuda or cuda:N"))
    block_size: int = setting(16, "tokens per KV block", check=POSITIVE_INT)
    kv_cache_gb: float = setting(1.0, "GiB of the paged KV pool; it must hold one max_model_len sequence",
                                 check=POSITIVE)
    max_num_batched_tokens: int = setting(2048, "per-step token budget; longer prefills are chunked",
                                          check=POSITIVE_INT)
    max_num_seqs: int = setting(256, "most requests in the running batch", check=POSITIVE_INT)
    max_model_len: int | None = setting(None, "context limit (unset: the model's own)", check=POSITIVE_INT)
    queue_policy: str = setting("fcfs", "order of the waiting queue (priority: Preble's per-hit-ratio quotas, "
                                "which bound lpm's starvation)", choices=QUEUE_POLICIES)
    attention_backend: str = setting("auto", "attention kernels (auto: flash on CUDA with flash-attn, else sdpa)",
                                     choices=ATTENTION_BACKENDS)
    weight_blocks: bool = setting(True, "where AMX runs the few-row linears of decode steps, multiply by a GGUF "
                                  "checkpoint's quantized weights as stored (4- or 8-bit blocks widened in "
                                  "registers: fewer bytes a step, the same results) instead of a bf16 copy")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes computed before")
    wait_for_shared_prefill: bool = setting(True, "a request whose next uncached prompt block another request "
                                            "is prefilling waits a step and reuses it, so a burst of copies "
                                            "of a long prompt prefills it once")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineSettings):
    """What an engine is built from: the operator's settings and what only code sets.

    The fields below are no operator settings, so they are not in EngineSettings:
    `model_dir` is the cluster's `model` (a directory or a GGUF file; svc resolves "" to the packaged default model);
    `num_kv_blocks`, when set, sizes the pool instead of `kv_cache_gb` (tests force
    preemption with it); a served worker roots each request at its own tenant, as the
    router does, so `tenant_salt` is only the offline engine's tenant for requests that
    name none; `adapter_id` is part of every block's name and no adapter is served yet.
    """

    model_dir: Path = setting(help="the checkpoint directory")
    num_kv_blocks: int | None = setting(None, "KV pool size in blocks; overrides kv_cache_gb", check=POSITIVE_INT)
    tenant_salt: str = setting("", "the tenant of requests that name none")
    adapter_id: str = setting("", "the adapter whose KV this engine computes")


def resolve_dtype(setting: str, device: str, cpu_bf16_native: bool) -> str:
    """The dtype (one of DTYPES) an engine on `device` (cpu, cuda or cuda:N) computes in
    for the `dtype` setting: an explicit dtype as given; "auto" bfloat16 on a GPU, and on
    a CPU bfloat16 only where oneDNN computes bf16 natively (`cpu_bf16_native`), since
    elsewhere every bf16 matmul falls back to torch's scalar GEMM, several times slower
    than fp32's; float32 there (docs/architecture.md §9). Torch-free, so the roles that
    load no torch resolve the same way. ValueError naming the setting for any other value."""
    if setting in DTYPES:
        return setting
    if setting != AUTO_DTYPE:
        raise ValueError(f"dtype: unsupported {setting!r}; choose one of {DTYPE_SETTINGS}")
    return "bfloat16" if device.startswith("cuda") or cpu_bf16_native else "float32"


def dtype_choice(setting: str, device: str, cpu_bf16_native: bool) -> str:
    """Why `resolve_dtype` chose what it did, for the engine's start-up log line."""
    chosen = resolve_dtype(setting, device, cpu_bf16_native)
    if setting != AUTO_DTYPE:
        return f"dtype: {chosen} (as set)"
    if device.startswith("cuda"):
        return f"dtype: auto -> {chosen} (GPU)"
    native = "computes bf16 natively" if cpu_bf16_native else "has no native bf16"
    return f"dtype: auto -> {chosen} (oneDNN {native} on this CPU)"


def engine_settings(settings: EngineSettings) -> dict[str, Any]:
    """Every engine setting of `settings` (an EngineSettings, a ClusterConfig or an
    EngineConfig) by name."""
    return {spec.name: getattr(settings, spec.name) for spec in fields(EngineSettings)}
