"""The random test models (tiny, small): Llama-architecture checkpoints with deterministic
random weights and a byte-level BPE tokenizer, written in Hugging Face format. Tests and
benchmarks run on them; what Baton serves by default is a real model
(common/engine/packaged_model.py).

It is written to disk and then loaded like any other checkpoint, so the real loading
path runs everywhere, and transformers can load the same directory to pin correctness.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.atomic_dir import cached_dir, fsync_file, write_dir_atomically, write_json
from common.cache_root import baton_cache_root
from common.engine.checkpoint import expected_tensors
from common.engine.config import ModelConfig

if TYPE_CHECKING:  # torch and tokenizers load lazily, only when a model is written
    import tokenizers

SIZES: dict[str, dict[str, Any]] = {
    size: {
        **dims,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "model_type": "llama",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    for size, dims in {
        "tiny": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "vocab_size": 512, "intermediate_size": 768},
        "small": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "num_key_value_heads": 4, "vocab_size": 32000, "intermediate_size": 2048},
    }.items()
}

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")  # ids 0..3
BOS_ID, EOS_ID, UNK_ID, PAD_ID = range(4)
MODEL_MAX_LENGTH = 4096
# Merged tokens stay short, as in real vocabularies, however many merges are made.
MAX_MERGED_TOKEN_CHARS = 12


def model_config(size: str = "tiny") -> ModelConfig:
    """The ModelConfig of a default model size (what load_model_config returns for it)."""
    dims = _size_dims(size)
    return ModelConfig(
        model_type=dims["model_type"],
        vocab_size=dims["vocab_size"],
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_layers=dims["num_hidden_layers"],
        num_heads=dims["num_attention_heads"],
        num_kv_heads=dims["num_key_value_heads"],
        head_dim=dims["hidden_size"] // dims["num_attention_heads"],
        rms_norm_eps=dims["rms_norm_eps"],
        rope_theta=dims["rope_theta"],
        max_position_embeddings=dims["max_position_embeddings"],
        tie_word_embeddings=dims["tie_word_embeddings"],
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        torch_dtype=dims["torch_dtype"],
    )


def write_default_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the default checkpoint of `size` with weights and merges drawn from `seed`.

    The same (size, seed) always gives byte-identical files. The checkpoint is built in
    a temporary directory beside `out_dir` and renamed into place, so `out_dir` is
    either absent or complete. Raises FileExistsError if `out_dir` is non-empty (also
    when another writer renamed its checkpoint there first). Returns `out_dir`.
    """
    _size_dims(size)  # an unknown size fails before anything is written
    return write_dir_atomically(Path(out_dir), lambda tmp_dir: _write_checkpoint_files(tmp_dir, size, seed))


def default_model_path(cache_root: Path | None = None, size: str = "tiny", seed: int = 0) -> Path:
    """Where the default model of (size, seed) lives; nothing is written."""
    return Path(cache_root or baton_cache_root()) / "models" / f"{size}-seed{seed}"


def default_model_dir(cache_root: Path | None = None, size: str = "tiny",
                      seed: int = 0) -> Path:
    """`<cache_root>/models/<size>-seed<seed>`, written on first use.

    `cache_root` defaults to $BATON_CACHE_DIR, else ~/.cache/baton. Safe when several
    processes race to create it: the losers use the winner's copy, identical anyway.
    """
    _size_dims(size)
    return cached_dir(default_model_path(cache_root, size, seed),
                      lambda tmp_dir: _write_checkpoint_files(tmp_dir, size, seed))


# ----------------------------------------------------------------------- files


def _write_checkpoint_files(out_dir: Path, size: str, seed: int) -> None:
    dims = _size_dims(size)
    write_json(out_dir / "config.json", _hf_config(dims))
    write_json(out_dir / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "do_sample": False,
    })
    _write_weights(out_dir / "model.safetensors", model_config(size), seed)
    _write_tokenizer_files(out_dir, dims["vocab_size"], seed)


def _hf_config(dims: dict[str, Any]) -> dict[str, Any]:
    """A LlamaConfig as config.json; the top-level rope_theta form loads in both
    transformers 4.x and 5 (which converts it to rope_parameters)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        **{k: dims[k] for k in sorted(dims)},
        "head_dim": dims["hidden_size"] // dims["num_attention_heads"],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "rope_scaling": None,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "use_cache": True,
    }


def _write_weights(path: Path, cfg: ModelConfig, seed: int) -> None:
    """Random weights scaled so activations and logits keep unit-order spread: linear
    weights N(0, 1/fan_in), embeddings N(0, 1), norm weights 1. Greedy decoding then
    rarely meets near-ties, so it is comparable across implementations."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        std = 1.0 if name == "model.embed_tokens.weight" else shape[-1] ** -0.5
        # normal_ draws in place: the small model is ~125M weights, so no extra copies.
        weight = torch.empty(shape).normal_(0.0, std, generator=generator)
        tensors[name] = weight.to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    fsync_file(path)


def _write_tokenizer_files(out_dir: Path, vocab_size: int, seed: int) -> None:
    build_tokenizer(vocab_size, seed).save(str(out_dir / "tokenizer.json"))
    fsync_file(out_dir / "tokenizer.json")
    special = dict(zip(("bos_token", "eos_token", "unk_token", "pad_token"), SPECIAL_TOKENS))
    write_json(out_dir / "special_tokens_map.json", special)
    write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "add_eos_token": False,
    })


def _size_dims(size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"unknown default model size {size!r} (known: {', '.join(SIZES)})")
    return SIZES[size]


# ------------------------------------------------------------------- tokenizer


def byte_to_unicode() -> list[str]:
    """The GPT-2 byte-level alphabet: entry b is the printable character standing for
    byte b (printable bytes stand for themselves, the rest map above U+0100)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) \
        | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def bpe_vocab_and_merges(vocab_size: int, seed: int) -> tuple[dict[str, int],
                                                              list[tuple[str, str]]]:
    """Special tokens (ids 0..3), the 256 byte tokens, then random merges until the
    vocabulary holds exactly `vocab_size` tokens. Merges mostly join tokens made of
    printable ASCII, so common text compresses somewhat, as with a trained BPE."""
    byte_chars = byte_to_unicode()
    if vocab_size < len(SPECIAL_TOKENS) + len(byte_chars):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the "
                         f"{len(SPECIAL_TOKENS) + 256} special and byte tokens")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *byte_chars])}
    ascii_chars = [byte_chars[b] for b in range(0x20, 0x7F)]  # printable ASCII + space
    ascii_tokens = list(ascii_chars)
    ascii_set = set(ascii_tokens)
    all_tokens = list(byte_chars)
    rng = random.Random(seed)
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pool, chars = (ascii_tokens, ascii_chars) if rng.random() < 0.9 \
            else (all_tokens, byte_chars)
        left = rng.choice(pool)
        # Half the merges extend a token by one character, which keeps lengths short.
        right = rng.choice(chars) if rng.random() < 0.5 else rng.choice(pool)
        merged = left + right
        if merged in vocab or len(merged) > MAX_MERGED_TOKEN_CHARS:
            continue
        vocab[merged] = len(vocab)
        merges.append((left, right))
        all_tokens.append(merged)
        if left in ascii_set and right in ascii_set:
            ascii_tokens.append(merged)
            ascii_set.add(merged)
    return vocab, merges


def build_tokenizer(vocab_size: int, seed: int) -> tokenizers.Tokenizer:
    """The default model's byte-level BPE tokenizer; encoding prepends `<s>` as Llama's
    tokenizers do, and every id decodes to some text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab, merges = bpe_vocab_and_merges(vocab_size, seed)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, BOS_ID)])
    tokenizer.add_special_tokens([AddedToken(tok, special=True) for tok in SPECIAL_TOKENS])
    return tokenizer
