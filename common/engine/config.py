"""Frozen configuration of a model and of an engine, passed explicitly everywhere."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
QUEUE_POLICIES = ("fcfs", "lpm", "priority")
DTYPES = ("bfloat16", "float32", "float16")
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


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from. `kv_cache_gb` sizes the paged KV pool in bytes;
    `num_kv_blocks`, when set, overrides it (tests use it to force preemption)."""

    model_dir: Path
    dtype: str = "bfloat16"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    queue_policy: str = "fcfs"
    attention_backend: str = "auto"  # "auto", "sdpa" or "flash"
    enable_prefix_caching: bool = True
    wait_for_shared_prefill: bool = True  # common/engine/scheduler.py's docstring
    tenant_salt: str = ""
    adapter_id: str = ""
