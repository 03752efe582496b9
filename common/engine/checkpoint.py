"""Loading a local Hugging Face checkpoint directory, validated up front.

A checkpoint directory holds config.json (+ optionally generation_config.json), the
weights as `model.safetensors`, as shards named by `model.safetensors.index.json`, or as
any `*.safetensors` files, and tokenizer.json. Every problem is reported as a
`CheckpointError` whose message starts with the offending path, so an operator can see
at once which file to fix.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from common.engine.config import (
    DTYPES,
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    RopeScaling,
)

if TYPE_CHECKING:  # torch and tokenizers load lazily: light processes read configs too
    import tokenizers
    import torch

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

DEFAULT_ROPE_THETA = 10000.0
# safetensors itself refuses headers above 100 MB; a larger length means a corrupt file.
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
FLOAT_SAFETENSORS_DTYPES = ("F16", "BF16", "F32", "F64")
# Activations the Llama-family MLP (SiLU-gated) computes; HF spells SiLU both ways.
SUPPORTED_HIDDEN_ACTS = ("silu", "swish")


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or inconsistent with the architecture.

    The message always names the file (or directory) and the problem, e.g.
    "/x/config.json: missing key 'hidden_size'".
    """


# --------------------------------------------------------------------------- config


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `<model_dir>/config.json` (and generation_config.json for extra EOS ids)
    into a validated ModelConfig. Raises CheckpointError on any problem."""
    model_dir = Path(model_dir)
    _require_dir(model_dir)
    path = model_dir / CONFIG_FILE
    raw = _read_json_object(path)

    model_type = _get_str(raw, "model_type", path)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: unsupported model_type {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act not in SUPPORTED_HIDDEN_ACTS:
        raise CheckpointError(f"{path}: unsupported hidden_act {hidden_act!r} (expected 'silu')")

    hidden_size = _get_positive_int(raw, "hidden_size", path)
    num_heads = _get_positive_int(raw, "num_attention_heads", path)
    num_kv_heads = _get_positive_int(raw, "num_key_value_heads", path, default=num_heads)
    head_dim = _head_dim(raw, hidden_size, num_heads, path)
    if num_heads % num_kv_heads != 0:
        raise CheckpointError(
            f"{path}: num_attention_heads {num_heads} is not a multiple of "
            f"num_key_value_heads {num_kv_heads}")

    rope_theta, rope_scaling = _rope(raw, path)
    return ModelConfig(
        model_type=model_type,
        vocab_size=_get_positive_int(raw, "vocab_size", path),
        hidden_size=hidden_size,
        intermediate_size=_get_positive_int(raw, "intermediate_size", path),
        num_layers=_get_positive_int(raw, "num_hidden_layers", path),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_get_positive_float(raw, "rms_norm_eps", path),
        rope_theta=rope_theta,
        max_position_embeddings=_get_positive_int(raw, "max_position_embeddings", path),
        tie_word_embeddings=_get_bool(raw, "tie_word_embeddings", path, default=False),
        # Qwen2 always has a bias on q/k/v; its configs do not say so.
        attention_bias=(model_type == "qwen2"
                        or _get_bool(raw, "attention_bias", path, default=False)),
        qk_norm=model_type == "qwen3",
        rope_scaling=rope_scaling,
        bos_token_id=_get_optional_token_id(raw, "bos_token_id", path),
        eos_token_ids=_eos_token_ids(raw, model_dir, path),
        torch_dtype=_torch_dtype(raw, path),
        sliding_window=_sliding_window(raw, model_type, path),
    )


def _sliding_window(raw: dict[str, Any], model_type: str, path: Path) -> int | None:
    """The window of a sliding-window model; Qwen configs carry one that is off unless
    `use_sliding_window` is true."""
    if raw.get("sliding_window") is None:
        return None
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    return _get_positive_int(raw, "sliding_window", path)


def _head_dim(raw: dict[str, Any], hidden_size: int, num_heads: int, path: Path) -> int:
    if raw.get("head_dim") is not None:
        # An explicit head_dim (Qwen3, Mistral-Nemo) need not equal hidden/heads.
        return _get_positive_int(raw, "head_dim", path)
    if hidden_size % num_heads != 0:
        raise CheckpointError(
            f"{path}: hidden_size {hidden_size} is not divisible by "
            f"num_attention_heads {num_heads}")
    return hidden_size // num_heads


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from either transformers 5's `rope_parameters` (which
    carries rope_theta and rope_type inside) or the older top-level `rope_theta` +
    `rope_scaling`."""
    params_key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(params_key) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: '{params_key}' must be an object or null, "
                              f"got {type(params).__name__}")
    if params.get("rope_theta") is not None:
        theta = _get_positive_float(params, "rope_theta", path, key_prefix=params_key + ".")
    else:
        theta = _get_positive_float(raw, "rope_theta", path, default=DEFAULT_ROPE_THETA)
    return theta, _rope_scaling(params, path, params_key)


def _rope_scaling(params: dict[str, Any], path: Path, params_key: str) -> RopeScaling:
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{path}: unsupported rope type {rope_type!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return RopeScaling()
    prefix = params_key + "."
    factor = _get_positive_float(params, "factor", path, key_prefix=prefix)
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    return RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=_get_positive_float(params, "low_freq_factor", path, key_prefix=prefix),
        high_freq_factor=_get_positive_float(params, "high_freq_factor", path, key_prefix=prefix),
        original_max_position_embeddings=_get_positive_int(
            params, "original_max_position_embeddings", path, key_prefix=prefix),
    )


def _eos_token_ids(raw: dict[str, Any], model_dir: Path, path: Path) -> tuple[int, ...]:
    """EOS ids of config.json then generation_config.json, in order, without repeats."""
    ids = _token_id_list(raw, "eos_token_id", path)
    generation_path = model_dir / GENERATION_CONFIG_FILE
    if generation_path.exists():
        ids += _token_id_list(_read_json_object(generation_path), "eos_token_id",
                              generation_path)
    return tuple(dict.fromkeys(ids))


def _token_id_list(raw: dict[str, Any], key: str, path: Path) -> list[int]:
    value = raw.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(_is_int(v) and v >= 0 for v in values):
        raise CheckpointError(f"{path}: '{key}' must be a token id or a list of token ids, "
                              f"got {value!r}")
    return list(values)


def _get_optional_token_id(raw: dict[str, Any], key: str, path: Path) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise CheckpointError(f"{path}: '{key}' must be a token id, got {value!r}")
    return value


def _torch_dtype(raw: dict[str, Any], path: Path) -> str:
    key = "torch_dtype" if raw.get("torch_dtype") is not None else "dtype"
    value = raw.get(key) or "bfloat16"
    if value not in DTYPES:
        raise CheckpointError(f"{path}: unsupported {key} {value!r} "
                              f"(supported: {', '.join(DTYPES)})")
    return value


# ---------------------------------------------------------------- typed JSON access


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MISSING = object()


def _lookup(raw: dict[str, Any], key: str, path: Path, default: Any, key_prefix: str) -> Any:
    value = raw.get(key)
    if value is None:
        if default is _MISSING:
            raise CheckpointError(f"{path}: missing key '{key_prefix}{key}'")
        return default
    return value


def _type_error(path: Path, key: str, expected: str, value: Any) -> CheckpointError:
    return CheckpointError(
        f"{path}: key '{key}' must be {expected}, got {type(value).__name__} {value!r}")


def _get_str(raw: dict[str, Any], key: str, path: Path) -> str:
    value = _lookup(raw, key, path, _MISSING, "")
    if not isinstance(value, str):
        raise _type_error(path, key, "a string", value)
    return value


def _get_positive_int(raw: dict[str, Any], key: str, path: Path, default: Any = _MISSING,
                      key_prefix: str = "") -> int:
    value = _lookup(raw, key, path, default, key_prefix)
    if not _is_int(value) or value <= 0:
        raise _type_error(path, key_prefix + key, "a positive integer", value)
    return value


def _get_positive_float(raw: dict[str, Any], key: str, path: Path, default: Any = _MISSING,
                        key_prefix: str = "") -> float:
    value = _lookup(raw, key, path, default, key_prefix)
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not math.isfinite(value) or value <= 0:
        raise _type_error(path, key_prefix + key, "a positive number", value)
    return float(value)


def _get_bool(raw: dict[str, Any], key: str, path: Path, default: bool) -> bool:
    value = _lookup(raw, key, path, default, "")
    if not isinstance(value, bool):
        raise _type_error(path, key, "a boolean", value)
    return value


def _require_dir(model_dir: Path) -> None:
    if not model_dir.exists():
        raise CheckpointError(f"{model_dir}: checkpoint directory does not exist")
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc.strerror or exc}") from exc


def _read_json_object(path: Path) -> dict[str, Any]:
    data = _read_bytes(path)
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------- weights


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes a checkpoint of `cfg` holds, in the
    order embed, layers 0..n-1, final norm, lm_head (absent when tied)."""
    hidden, q_size, kv_size = cfg.hidden_size, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[f"{layer}.self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[f"{layer}.self_attn.v_proj.weight"] = (kv_size, hidden)
        if cfg.attention_bias:
            shapes[f"{layer}.self_attn.q_proj.bias"] = (q_size,)
            shapes[f"{layer}.self_attn.k_proj.bias"] = (kv_size,)
            shapes[f"{layer}.self_attn.v_proj.bias"] = (kv_size,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, q_size)
        if cfg.qk_norm:
            shapes[f"{layer}.self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"{layer}.self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (cfg.intermediate_size, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (cfg.intermediate_size, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, cfg.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The header of one safetensors file: its raw bytes (8-byte length + JSON) and the
    tensors it lists."""

    path: Path
    raw: bytes
    tensors: dict[str, TensorInfo]


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Read and check the header of a safetensors file without touching the weights.
    Raises CheckpointError if the file is missing, truncated or its header is corrupt."""
    try:
        with path.open("rb") as f:
            file_size = path.stat().st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors file: shorter than "
                                      f"its 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_SAFETENSORS_HEADER_BYTES, file_size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors file: header length "
                                      f"{header_len} does not fit a {file_size}-byte file")
            header = f.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc.strerror or exc}") from exc
    tensors = _parse_safetensors_header(path, header, data_size=file_size - 8 - header_len)
    return SafetensorsHeader(path=path, raw=prefix + header, tensors=tensors)


def _parse_safetensors_header(path: Path, header: bytes, data_size: int) -> dict[str, TensorInfo]:
    try:
        entries = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            _start, end = (int(o) for o in entry["data_offsets"])
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: bad entry for tensor {name!r}") from exc
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end} "
                f"of the data but the file holds only {data_size}")
        tensors[name] = TensorInfo(dtype=str(dtype), shape=shape)
    return tensors


def weight_files(model_dir: Path) -> tuple[Path, list[Path]]:
    """(source, files): where the weights come from and the safetensors files to read.

    `source` names the checkpoint's weights in error messages: model.safetensors, the
    index file, or the directory when all its *.safetensors are read.
    """
    model_dir = Path(model_dir)
    _require_dir(model_dir)
    single = model_dir / SINGLE_WEIGHTS_FILE
    if single.exists():
        return single, [single]
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.exists():
        return index, _index_shards(index)
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{model_dir}: no safetensors weights "
                              f"(expected {SINGLE_WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE} "
                              f"or *.safetensors)")
    return model_dir, files


def _index_shards(index: Path) -> list[Path]:
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise CheckpointError(f"{index}: missing or malformed 'weight_map' "
                              f"(expected an object of tensor name -> shard file)")
    shards = []
    for shard_name in sorted(set(weight_map.values())):
        shard = index.parent / shard_name
        if not shard.is_file():
            tensor = next(t for t, s in weight_map.items() if s == shard_name)
            raise CheckpointError(f"{index}: shard {shard_name!r} (holding tensor "
                                  f"{tensor!r}) does not exist at {shard}")
        shards.append(shard)
    return shards


def _is_ignorable_extra(name: str, cfg: ModelConfig) -> bool:
    # Old exports saved RoPE caches as buffers; they are recomputed, never loaded.
    if ".rotary_emb." in name:
        return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"


def _locate_tensors(source: Path, headers: list[SafetensorsHeader],
                    cfg: ModelConfig) -> dict[str, Path]:
    """Check names, shapes and dtypes against the architecture using only the headers;
    return which file holds each expected tensor."""
    expected = expected_tensors(cfg)
    location: dict[str, Path] = {}
    for header in headers:
        for name, info in header.tensors.items():
            if name in location:
                raise CheckpointError(f"{header.path}: tensor {name!r} is also in "
                                      f"{location[name]}")
            if name not in expected:
                if _is_ignorable_extra(name, cfg):
                    continue
                raise CheckpointError(f"{header.path}: unexpected tensor {name!r} for a "
                                      f"{cfg.model_type} model of this config")
            if info.shape != expected[name]:
                raise CheckpointError(f"{header.path}: tensor {name!r} has shape "
                                      f"{info.shape}, expected {expected[name]}")
            if info.dtype not in FLOAT_SAFETENSORS_DTYPES:
                raise CheckpointError(f"{header.path}: tensor {name!r} has dtype "
                                      f"{info.dtype}, expected a floating-point dtype")
            location[name] = header.path
    missing = [name for name in expected if name not in location]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}{more}")
    return location


def load_state_dict(model_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of expected_tensors(cfg), keyed by HF name, in the stored dtype.

    All names, shapes and dtypes are checked from the headers before any weight is
    read. Raises CheckpointError on a missing/corrupt file or shard, a missing, extra or
    mis-shaped tensor.
    """
    from safetensors import SafetensorError, safe_open

    source, files = weight_files(model_dir)
    headers = [read_safetensors_header(path) for path in files]
    location = _locate_tensors(source, headers, cfg)
    state: dict[str, Any] = {}
    for path in files:
        names = [name for name, where in location.items() if where == path]
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    state[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file: {exc}") from exc
    return {name: state[name] for name in expected_tensors(cfg)}


# ----------------------------------------------------------------------- tokenizer


def load_tokenizer(model_dir: Path) -> tokenizers.Tokenizer:
    """The checkpoint's `tokenizer.json` as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust binding raises a bare Exception
        raise CheckpointError(f"{path}: malformed tokenizer: {exc}") from exc


# --------------------------------------------------------------------- fingerprints


def fingerprints(model_dir: Path) -> tuple[str, str]:
    """(model_fingerprint, tokenizer_fingerprint) as 16-hex-digit xxh3-64 digests.

    The model's covers config.json and, for each *.safetensors file in name order, its
    name, size and header (names, dtypes, shapes, offsets), not the weight bytes, so it
    is cheap for large checkpoints. The tokenizer's covers tokenizer.json. Both are
    stable across processes and machines.
    """
    model_dir = Path(model_dir)
    _require_dir(model_dir)
    model_hash = xxhash.xxh3_64()
    _update_framed(model_hash, _read_bytes(model_dir / CONFIG_FILE))
    for path in sorted(model_dir.glob("*.safetensors")):
        header = read_safetensors_header(path)
        _update_framed(model_hash, path.name.encode())
        _update_framed(model_hash, str(path.stat().st_size).encode())
        _update_framed(model_hash, header.raw)
    tokenizer_hash = xxhash.xxh3_64(_read_bytes(model_dir / TOKENIZER_FILE))
    return model_hash.hexdigest(), tokenizer_hash.hexdigest()


def _update_framed(h: xxhash.xxh3_64, data: bytes) -> None:
    # Length-prefixing keeps (name, size, header) fields from running into each other.
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
