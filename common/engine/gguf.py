"""GGUF checkpoints (llama.cpp's one-file format), read by converting them once into an
ordinary Hugging Face checkpoint directory.

`checkpoint_dir(model)` is what every role calls on its `--model` value: a directory is
returned as given; a GGUF file is converted, the first time, into
`<cache>/gguf/<xxh3-128 of its bytes>-v<CONVERSION_VERSION>/` (config.json,
generation_config.json, model.safetensors in float32, tokenizer.json,
tokenizer_config.json) and that directory is returned, so the rest of Baton (the loader,
the fingerprints, the chat template) reads a plain checkpoint. Being keyed by content,
every process and every machine holding the same file ends with identical files, hence
identical fingerprints; a later start only hashes the file (a fraction of a second per
GB) and finds the conversion done.

What is read: the `llama` architecture; tensors of the types in SUPPORTED_TENSOR_TYPES,
dequantized to float32 with the `gguf` package, and the quantized ones also kept as
stored, in BLOCKS_FILE (weight_blocks: where AMX runs them, decode steps multiply by the
4- or 8-bit blocks, kernels/linear.py); the tokenizer the metadata describes
(common/engine/gguf_tokenizer.py). Anything else is refused with a CheckpointError that
starts with the file's path and names what is not supported.

Torch-free (numpy, gguf, safetensors): the tokenizer and kvstore roles resolve `--model`
too.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from common.atomic_dir import cached_dir, fsync_file, write_dir_atomically, write_json
from common.cache_root import baton_cache_root
from common.engine.checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SINGLE_WEIGHTS_FILE,
    TOKENIZER_FILE,
    WEIGHTS_INDEX_FILE,
    CheckpointError,
    expected_tensors,
    load_model_config,
)
from common.engine.config import ModelConfig, RopeScaling
from common.engine.gguf_tokenizer import GgufVocab, build_tokenizer, read_vocab, tokenizer_config
from common.logs import get_logger

if TYPE_CHECKING:
    from gguf import ReaderTensor

GGUF_SUFFIX = ".gguf"
# Part of the cache key: raise it whenever the files a conversion writes change, so that
# conversions made by an older Baton are not reused.
CONVERSION_VERSION = 2
CACHE_SUBDIR = "gguf"
SOURCE_FILE = "gguf_source.json"  # where the conversion came from (not read by the loader)
# The quantized weights as stored (weight_blocks), in safetensors format but not named
# *.safetensors: loaders that read every *.safetensors of a directory (vLLM's) would take
# them for weights.
BLOCKS_FILE = "gguf_blocks.st"
BLOCK_VALUES = 32  # values in a block of every type in BLOCK_BYTES
BLOCK_BYTES: Mapping[str, int] = MappingProxyType({"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34})

GGUF_MAGIC = b"GGUF"
READABLE_VERSIONS = (2, 3)
SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
SUPPORTED_ROPE_SCALING = ("none", "linear")
# Shards of the float32 weights: each is held in memory twice while written.
MAX_SHARD_BYTES = 2 << 30
DIGEST_CHUNK_BYTES = 16 << 20

# GGUF tensor names -> Hugging Face Llama names (llama.cpp's gguf-py tensor_mapping).
GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})
LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
})
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")

log = get_logger("gguf")


# ------------------------------------------------------------------------ entry points


def is_gguf_path(path: Path) -> bool:
    """Whether a `--model` value names a GGUF file rather than a checkpoint directory:
    any path ending in .gguf, or any existing file (a checkpoint is a directory)."""
    return path.suffix.lower() == GGUF_SUFFIX or path.is_file()


def checkpoint_dir(model: str | Path, cache_root: Path | None = None,
                   on_convert: Callable[[Path, Path], None] | None = None) -> Path:
    """The Hugging Face checkpoint directory a `--model` value names.

    A directory (or a path that is neither a directory nor a GGUF file: the loader then
    says what is wrong) is returned as given. A GGUF file is converted once into
    `<cache_root>/gguf/<digest>-v<CONVERSION_VERSION>/` (cache_root defaults to
    $BATON_CACHE_DIR, else ~/.cache/baton) and that directory is returned; processes
    racing to convert the same file all end with the one complete copy.
    `on_convert(file, directory)` is called before a conversion starts (not when the
    directory is there already). Raises CheckpointError, naming the file, for a file that
    is missing, damaged or not supported.
    """
    path = Path(model)
    if path.is_dir() or not is_gguf_path(path):
        return path
    _require_file(path)
    digest = file_digest(path)
    out_dir = Path(cache_root or baton_cache_root()) / CACHE_SUBDIR / f"{digest}-v{CONVERSION_VERSION}"

    def convert(tmp_dir: Path) -> None:
        if on_convert is not None:
            on_convert(path, out_dir)
        write_checkpoint(path, tmp_dir, digest)

    return cached_dir(out_dir, convert)


def convert_gguf(gguf_path: Path, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Convert `gguf_path` into a new checkpoint directory `out_dir` (built beside it and
    renamed into place; FileExistsError if `out_dir` is not empty). Returns `out_dir`."""
    gguf_path = Path(gguf_path)
    _require_file(gguf_path)
    digest = file_digest(gguf_path)
    return write_dir_atomically(Path(out_dir), lambda tmp_dir: write_checkpoint(gguf_path, tmp_dir, digest,
                                                                                 max_shard_bytes))


def file_digest(path: Path) -> str:
    """The xxh3-128 digest of the file's bytes, as 32 hex digits."""
    digest = xxhash.xxh3_128()
    try:
        with path.open("rb") as f:
            while chunk := f.read(DIGEST_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def write_checkpoint(gguf_path: Path, out_dir: Path, digest: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write the Hugging Face checkpoint of a GGUF file into the empty directory `out_dir`.

    Everything is checked (header, metadata, tokenizer, tensor names, types and shapes)
    before the weights are dequantized; a CheckpointError names the file and the problem.
    """
    started = time.perf_counter()
    gguf, vocab, cfg, plans = _inspect(gguf_path)
    log.info("gguf_convert", file=str(gguf_path), tensors=len(plans), out=str(out_dir))
    write_json(out_dir / CONFIG_FILE, hf_config(cfg, vocab))
    write_json(out_dir / GENERATION_CONFIG_FILE, generation_config(vocab))
    build_tokenizer(vocab, gguf_path).save(str(out_dir / TOKENIZER_FILE))
    fsync_file(out_dir / TOKENIZER_FILE)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(vocab, cfg.max_position_embeddings))
    _write_weights(plans, out_dir, max_shard_bytes)
    _write_blocks(plans, out_dir)
    write_json(out_dir / SOURCE_FILE, {"file": gguf_path.name, "bytes": gguf_path.stat().st_size,
                                       "xxh3_128": digest, "conversion_version": CONVERSION_VERSION})
    if load_model_config(out_dir) != cfg:
        raise RuntimeError(f"{out_dir}: the written config.json does not read back as the GGUF file's config")
    log.info("gguf_converted", file=str(gguf_path), seconds=round(time.perf_counter() - started, 2))


def check_gguf(gguf_path: Path) -> ModelConfig:
    """Every check of a conversion (header, metadata, tokenizer, tensor names, types and
    shapes) without dequantizing or writing anything; returns the model's config."""
    _, vocab, cfg, _ = _inspect(gguf_path)
    build_tokenizer(vocab, gguf_path)
    return cfg


def _inspect(gguf_path: Path) -> tuple[GgufFile, GgufVocab, ModelConfig, list[TensorPlan]]:
    gguf = read_gguf(gguf_path)
    vocab = read_vocab(gguf.metadata, gguf_path)
    cfg = model_config(gguf, vocab)
    return gguf, vocab, cfg, plan_tensors(gguf, cfg)


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's metadata (key -> Python value, arrays as lists) and its tensors by
    name; the tensors' data are views of the file, mapped into memory."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, ReaderTensor]


def read_gguf(path: Path) -> GgufFile:
    """Open and check a GGUF file: CheckpointError for a missing file, a bad magic, a
    big-endian file, a version other than READABLE_VERSIONS, or one the reader cannot
    parse or whose tensors run past its end (truncated or damaged)."""
    from gguf import GGUFReader

    _check_header(path)
    try:
        reader = GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError) as exc:
        # A short file makes the reader's views come up short: a failed reshape or index.
        raise CheckpointError(f"{path}: truncated or damaged GGUF file ({type(exc).__name__}: {exc})") from exc
    file_size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise CheckpointError(f"{path}: truncated GGUF file: tensor {tensor.name} ends at byte "
                                  f"{tensor.data_offset + tensor.n_bytes} of a {file_size}-byte file")
    return GgufFile(path=path, metadata=metadata, tensors={tensor.name: tensor for tensor in reader.tensors})


def _require_file(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"{path}: no such GGUF file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file (a GGUF checkpoint is one file)")


def _check_header(path: Path) -> None:
    _require_file(path)
    try:
        with path.open("rb") as f:
            header = f.read(8)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc.strerror or exc}") from exc
    if header[:4] != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {header[:4]!r}, not {GGUF_MAGIC!r})")
    if len(header) < 8:
        raise CheckpointError(f"{path}: truncated GGUF file: {len(header)} bytes")
    version = int.from_bytes(header[4:8], "little")
    if version not in READABLE_VERSIONS and int.from_bytes(header[4:8], "big") in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: a big-endian GGUF file, which Baton does not read")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: GGUF version {version}, which Baton does not read "
                              f"(readable: {', '.join(map(str, READABLE_VERSIONS))})")


# ------------------------------------------------------------------------------- config


def model_config(gguf: GgufFile, vocab: GgufVocab) -> ModelConfig:
    """The architecture the metadata describes, as load_model_config would return it for
    the converted checkpoint. The vocabulary size is the embedding's row count."""
    meta, path = gguf.metadata, gguf.path
    arch = _architecture(meta, path)
    parts = _int(meta, "split.count", path, default=1)
    if parts > 1:
        raise CheckpointError(f"{path}: one part of a GGUF file split in {parts} (split.count), which Baton does "
                              f"not read; merge the parts first (llama.cpp's llama-gguf-split --merge)")
    hidden = _int(meta, f"{arch}.embedding_length", path)
    heads = _int(meta, f"{arch}.attention.head_count", path)
    head_dim = _head_dim(meta, arch, hidden, heads, path)
    kv_heads = _int(meta, f"{arch}.attention.head_count_kv", path, default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: {arch}.attention.head_count {heads} is not a multiple of "
                              f"{arch}.attention.head_count_kv {kv_heads}")
    if _int(meta, f"{arch}.expert_count", path, default=0, minimum=0):
        raise CheckpointError(f"{path}: a mixture-of-experts model ({arch}.expert_count), which Baton does not run")
    vocab_size = _vocab_size(gguf, arch, len(vocab.tokens))
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_int(meta, f"{arch}.feed_forward_length", path),
        num_layers=_int(meta, f"{arch}.block_count", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", path),
        rope_theta=_float(meta, f"{arch}.rope.freq_base", path, default=10000.0),
        max_position_embeddings=_int(meta, f"{arch}.context_length", path),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=_rope_scaling(meta, arch, path),
        bos_token_id=vocab.bos_id,
        eos_token_ids=vocab.end_of_generation_ids,
        torch_dtype="float32",
    )


def hf_config(cfg: ModelConfig, vocab: GgufVocab) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with `cfg`'s shape (what transformers writes)."""
    scaling = cfg.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if scaling.rope_type == "default" else {"rope_type": scaling.rope_type,
                                                                      "factor": scaling.factor},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": vocab.eos_id,
        "pad_token_id": vocab.pad_id,
        "torch_dtype": cfg.torch_dtype,
    }


def generation_config(vocab: GgufVocab) -> dict[str, Any]:
    """generation_config.json: every end-of-generation id the file names (eos, eot, eom)."""
    eos: int | list[int] | None = list(vocab.end_of_generation_ids) or None
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    return {"bos_token_id": vocab.bos_id, "eos_token_id": eos, "pad_token_id": vocab.pad_id}


def _architecture(meta: Mapping[str, Any], path: Path) -> str:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(f"{path}: metadata general.architecture is missing")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} (general.architecture), which Baton does not read "
                              f"from GGUF; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _head_dim(meta: Mapping[str, Any], arch: str, hidden: int, heads: int, path: Path) -> int:
    if f"{arch}.attention.key_length" not in meta and hidden % heads:
        raise CheckpointError(f"{path}: {arch}.embedding_length {hidden} is not divisible by "
                              f"{arch}.attention.head_count {heads}")
    head_dim = _int(meta, f"{arch}.attention.key_length", path, default=hidden // heads)
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        # Baton ropes whole heads, with values as wide as keys.
        if _int(meta, key, path, default=head_dim) != head_dim:
            raise CheckpointError(f"{path}: {key} {meta[key]} differs from the head size {head_dim}, "
                                  f"which Baton does not support")
    return head_dim


def _vocab_size(gguf: GgufFile, arch: str, tokens: int) -> int:
    path = gguf.path
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None:
        raise CheckpointError(f"{path}: missing tensor token_embd.weight")
    rows = int(embedding.shape[-1])  # GGUF lists dimensions innermost first
    stated = _int(gguf.metadata, f"{arch}.vocab_size", path, default=rows)
    if stated != rows:
        raise CheckpointError(f"{path}: {arch}.vocab_size {stated} differs from the {rows} rows of "
                              f"token_embd.weight")
    if tokens > rows:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens lists {tokens} tokens, more than the {rows} rows "
                              f"of token_embd.weight")
    return rows


def _rope_scaling(meta: Mapping[str, Any], arch: str, path: Path) -> RopeScaling:
    key = f"{arch}.rope.scaling.type"
    kind = meta.get(key, "linear" if f"{arch}.rope.scale_linear" in meta else "none")
    if kind not in SUPPORTED_ROPE_SCALING:
        raise CheckpointError(f"{path}: RoPE scaling {kind!r} ({key}), which Baton does not support; "
                              f"supported: {', '.join(SUPPORTED_ROPE_SCALING)}")
    if kind == "none":
        return RopeScaling()
    factor_key = f"{arch}.rope.scaling.factor" if f"{arch}.rope.scaling.factor" in meta else f"{arch}.rope.scale_linear"
    return RopeScaling(rope_type="linear", factor=_float(meta, factor_key, path))


_MISSING = object()


def _int(meta: Mapping[str, Any], key: str, path: Path, default: Any = _MISSING, minimum: int = 1) -> int:
    value = meta.get(key, default)
    if value is _MISSING:
        raise CheckpointError(f"{path}: metadata {key} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointError(f"{path}: metadata {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(meta: Mapping[str, Any], key: str, path: Path, default: Any = _MISSING) -> float:
    value = meta.get(key, default)
    if value is _MISSING:
        raise CheckpointError(f"{path}: metadata {key} is missing")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{path}: metadata {key} must be a positive number, got {value!r}")
    return _shortest_float32(float(value))


def _shortest_float32(value: float) -> float:
    """A float32 value as the shortest decimal that reads back as it (the 1e-05 the
    model's own config said, not 9.999999747378752e-06): the same float32 either way."""
    single = np.float32(value)
    return float(str(single)) if float(single) == value else value


# ------------------------------------------------------------------------------ weights


@dataclass(frozen=True)
class TensorPlan:
    """One Hugging Face tensor and the GGUF tensor it comes from. `permuted_heads` is the
    head count of a q or k projection, whose rows llama.cpp's converter reordered per head
    (0 for every other tensor)."""

    hf_name: str
    source: ReaderTensor
    shape: tuple[int, ...]
    permuted_heads: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4  # written as float32


def plan_tensors(gguf: GgufFile, cfg: ModelConfig) -> list[TensorPlan]:
    """The tensors of the converted checkpoint in expected_tensors order, each checked
    for its GGUF name, type and shape; CheckpointError names the first bad one."""
    by_hf_name: dict[str, ReaderTensor] = {}
    for name, tensor in gguf.tensors.items():
        by_hf_name[_hf_name(name, cfg, gguf.path)] = tensor
        _check_type(tensor, gguf.path)
    plans = []
    for hf_name, shape in expected_tensors(cfg).items():
        if hf_name not in by_hf_name:
            raise CheckpointError(f"{gguf.path}: missing tensor {_gguf_name(hf_name)} for the metadata's "
                                  f"{cfg.num_layers}-layer model")
        tensor = by_hf_name[hf_name]
        dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the innermost first
        if dims != shape:
            raise CheckpointError(f"{gguf.path}: tensor {tensor.name} has shape {dims}, but the metadata "
                                  f"asks for {shape}")
        heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(hf_name.split(".")[-2], 0)
        plans.append(TensorPlan(hf_name=hf_name, source=tensor, shape=shape, permuted_heads=heads))
    return plans


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows.

    Hugging Face's Llama ropes dimension i of a head with dimension i + head_dim/2
    (rotate_half); llama.cpp ropes adjacent pairs (2i, 2i+1). Its converter therefore
    writes, within each head, row i of the first half then row i of the second half, for
    i = 0..head_dim/2-1: GGUF row (head, i, half) holds HF row (head, half, i). Returns
    the HF-ordered rows."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def dequantized(plan: TensorPlan) -> np.ndarray:
    """The tensor in float32, in Hugging Face layout."""
    from gguf.quants import dequantize

    source = plan.source
    weight = np.asarray(dequantize(source.data, source.tensor_type), dtype=np.float32).reshape(plan.shape)
    if plan.permuted_heads:
        weight = unpermute_qk(weight, plan.permuted_heads)
    return np.ascontiguousarray(weight)


@dataclass(frozen=True)
class WeightBlocks:
    """A quantized weight [N, K] as its GGUF blocks hold it: value = scale * q + minimum
    for the 32 values along K of each block, computed in float32 exactly as `dequantized`
    does (scale * q is exact: an fp16 scale times an integer below 256). `q` int8 [N, K]
    (0..15 where bits is 4), `scale` and `minimum` float16 [N, K / 32]."""

    q: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray
    bits: int


def weight_blocks(plan: TensorPlan) -> WeightBlocks | None:
    """The quantized 2-D tensor of `plan` as stored, in Hugging Face row order; None for
    an unquantized one or one of another rank."""
    type_name = plan.source.tensor_type.name
    if type_name not in BLOCK_BYTES or len(plan.shape) != 2:
        return None
    raw = np.asarray(plan.source.data).reshape(-1, BLOCK_BYTES[type_name])
    scale = raw[:, 0:2].copy().view(np.float16)
    has_minimum = type_name in ("Q4_1", "Q5_1")
    minimum = raw[:, 2:4].copy().view(np.float16) if has_minimum else np.zeros_like(scale)
    rest = raw[:, 4 if has_minimum else 2:]
    if type_name == "Q8_0":
        q = rest.view(np.int8)
    else:
        high_bits: np.ndarray = np.zeros((), dtype=np.uint32)
        if type_name in ("Q5_0", "Q5_1"):  # bit j of a little-endian uint32 is value j's fifth bit
            high_bits = ((rest[:, :4].copy().view("<u4") >> np.arange(BLOCK_VALUES, dtype=np.uint32)) & 1) << 4
            rest = rest[:, 4:]
        # byte j holds value j in its low nibble and value j + 16 in its high one
        q = (np.concatenate([rest & 0x0F, rest >> 4], axis=1) | high_bits).astype(np.int8)
        if type_name == "Q4_0":  # d * (q - 8): kept as 0..15 with a minimum of -8d (exact in fp16)
            minimum = (scale * np.float16(-8)).astype(np.float16)
        elif type_name == "Q5_0":
            q = q - np.int8(16)
    rows, cols = plan.shape
    per_block = (rows, cols // BLOCK_VALUES)
    arrays: list[np.ndarray] = [q.reshape(rows, cols), scale.reshape(per_block), minimum.reshape(per_block)]
    if plan.permuted_heads:
        arrays = [unpermute_qk(array, plan.permuted_heads) for array in arrays]
    q, scale, minimum = (np.ascontiguousarray(array) for array in arrays)
    return WeightBlocks(q, scale, minimum, 4 if type_name in ("Q4_0", "Q4_1") else 8)


def read_weight_blocks(model_dir: Path) -> dict[str, WeightBlocks]:
    """The BLOCKS_FILE of a converted checkpoint by Hugging Face tensor name ({} where
    there is none: an HF checkpoint, or a GGUF file of unquantized tensors); a
    CheckpointError names the file where it is unreadable or a tensor is malformed."""
    from safetensors import SafetensorError, safe_open

    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}
    blocks: dict[str, WeightBlocks] = {}
    try:
        with safe_open(str(path), framework="np") as f:
            bits = f.metadata() or {}
            for name, value in bits.items():
                q, scale, minimum = (f.get_tensor(f"{name}.{part}") for part in ("q", "scale", "min"))
                blocks[name] = _checked_blocks(path, name, value, q, scale, minimum)
    except (SafetensorError, OSError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable quantized blocks: {exc}") from exc
    return blocks


def _checked_blocks(path: Path, name: str, bits: str, q: np.ndarray, scale: np.ndarray,
                    minimum: np.ndarray) -> WeightBlocks:
    if bits not in ("4", "8"):
        raise CheckpointError(f"{path}: {name}: bits {bits!r}, expected 4 or 8")
    shape = (q.shape[0], q.shape[1] // BLOCK_VALUES) if q.ndim == 2 else None
    if (q.dtype != np.int8 or shape is None or q.shape[1] % BLOCK_VALUES
            or scale.dtype != np.float16 or minimum.dtype != np.float16
            or scale.shape != shape or minimum.shape != shape):
        raise CheckpointError(f"{path}: {name}: malformed blocks (q {q.dtype} {q.shape}, scale {scale.dtype} "
                              f"{scale.shape}, min {minimum.dtype} {minimum.shape})")
    return WeightBlocks(q, scale, minimum, int(bits))


def _write_blocks(plans: list[TensorPlan], out_dir: Path) -> None:
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    bits: dict[str, str] = {}
    for plan in plans:
        blocks = weight_blocks(plan)
        if blocks is not None:
            tensors.update({f"{plan.hf_name}.q": blocks.q, f"{plan.hf_name}.scale": blocks.scale,
                            f"{plan.hf_name}.min": blocks.minimum})
            bits[plan.hf_name] = str(blocks.bits)
    if tensors:
        save_file(tensors, str(out_dir / BLOCKS_FILE), metadata=bits)
        (out_dir / BLOCKS_FILE).chmod(0o644)
        fsync_file(out_dir / BLOCKS_FILE)


def _hf_name(name: str, cfg: ModelConfig, path: Path) -> str:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    if name == "rope_freqs.weight":
        raise CheckpointError(f"{path}: tensor rope_freqs.weight (per-frequency RoPE factors, as Llama 3.1 "
                              f"files carry), which Baton does not read from GGUF")
    match = LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in LAYER_TENSORS or int(match.group(1)) >= cfg.num_layers:
        raise CheckpointError(f"{path}: unexpected tensor {name} for a {cfg.num_layers}-layer llama model")
    return f"model.layers.{int(match.group(1))}.{LAYER_TENSORS[match.group(2)]}"


def _gguf_name(hf_name: str) -> str:
    for gguf_name, hf in GLOBAL_TENSORS.items():
        if hf == hf_name:
            return gguf_name
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}." + next(g for g, hf in LAYER_TENSORS.items() if hf == rest)


def _check_type(tensor: ReaderTensor, path: Path) -> None:
    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise CheckpointError(f"{path}: tensor {tensor.name} has type {type_name}, which Baton does not read; "
                              f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")


def _write_weights(plans: list[TensorPlan], out_dir: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or shards of at most `max_shard_bytes` (but one tensor each at
    least) and their index; only one shard's tensors are in memory at a time."""
    from safetensors.numpy import save_file

    shards = _shards(plans, max_shard_bytes)
    names = [SINGLE_WEIGHTS_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        save_file({plan.hf_name: dequantized(plan) for plan in shard}, str(out_dir / name),
                  metadata={"format": "pt"})
        (out_dir / name).chmod(0o644)  # safetensors creates it 0o600, which would hide a shared cache
        fsync_file(out_dir / name)
    if len(shards) > 1:
        write_json(out_dir / WEIGHTS_INDEX_FILE, {
            "metadata": {"total_size": sum(plan.nbytes for plan in plans)},
            "weight_map": {plan.hf_name: name for name, shard in zip(names, shards, strict=True) for plan in shard},
        })


def _shards(plans: list[TensorPlan], max_shard_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if shards[-1] and size + plan.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += plan.nbytes
    return shards
