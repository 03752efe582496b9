"""The tokenizer a GGUF file describes, rebuilt for the `tokenizers` library.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary, its token types,
the BPE merges, the special token ids and the name of a pre-tokenizer (`tokenizer.ggml.pre`,
which selects the regexes llama.cpp splits text with before BPE) as metadata. This module
turns that metadata into the tokenizer.json and tokenizer_config.json of a Hugging Face
checkpoint that tokenizes as llama.cpp does. Only what it can reproduce exactly is
accepted: the byte-level BPE vocabulary (`gpt2`) with a pre-tokenizer listed in
PRE_TOKENIZERS; anything else is refused by name, never approximated.

Torch-free: the tokenizer role converts GGUF files too.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from common.engine.checkpoint import CheckpointError

if TYPE_CHECKING:
    import tokenizers

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)
TOKEN_TYPES = (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text for one `tokenizer.ggml.pre` value.

    `isolate` are the regexes llama.cpp applies before the GPT-2 regex, each cutting every
    piece into its matches and the text between them; `clean_spaces` is llama.cpp's
    clean-up of spaces before punctuation when it detokenizes (transformers'
    clean_up_tokenization_spaces).
    """

    isolate: tuple[str, ...]
    clean_spaces: bool


# From llama.cpp's src/llama-vocab.cpp: "gpt-2" splits with the GPT-2 regex alone;
# "smollm" first isolates every numeric character (\p{N}), then applies the GPT-2 regex,
# and does not clean spaces when detokenizing.
PRE_TOKENIZERS: Mapping[str, PreTokenizer] = MappingProxyType({
    "gpt-2": PreTokenizer(isolate=(), clean_spaces=True),
    "smollm": PreTokenizer(isolate=(r"\p{N}",), clean_spaces=False),
})


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer metadata of a GGUF file, checked."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[tuple[str, str], ...]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    end_of_generation_ids: tuple[int, ...]  # eos, then eot and eom where the file names them
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def read_vocab(meta: Mapping[str, Any], path: Path) -> GgufVocab:
    """The tokenizer described by a GGUF file's metadata; CheckpointError (naming `path`
    and the key) for a tokenizer Baton cannot reproduce or malformed metadata."""
    model = _str(meta, "tokenizer.ggml.model", path)
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise CheckpointError(f"{path}: tokenizer model {model!r} (tokenizer.ggml.model), which Baton does "
                              f"not read; supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}")
    pre = meta.get("tokenizer.ggml.pre", "default")  # llama.cpp's name for a file that names none
    if pre not in PRE_TOKENIZERS:
        where = "tokenizer.ggml.pre" if "tokenizer.ggml.pre" in meta else "no tokenizer.ggml.pre"
        raise CheckpointError(f"{path}: pre-tokenizer {pre!r} ({where}), which Baton does not "
                              f"read; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = _str_list(meta, "tokenizer.ggml.tokens", path)
    token_types = _token_types(meta, len(tokens), path)
    ids = {name: _token_id(meta, f"tokenizer.ggml.{name}_token_id", len(tokens), path)
           for name in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    add_bos = _bool(meta, "tokenizer.ggml.add_bos_token", path, default=False)
    add_eos = _bool(meta, "tokenizer.ggml.add_eos_token", path, default=False)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and ids[name] is None:
            raise CheckpointError(f"{path}: tokenizer.ggml.add_{name}_token is set but the file "
                                  f"has no tokenizer.ggml.{name}_token_id")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{path}: metadata tokenizer.chat_template must be a string")
    return GgufVocab(
        model=model, pre=pre, tokens=tuple(tokens), token_types=token_types,
        merges=_merges(meta, path), bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unknown"],
        pad_id=ids["padding"],
        end_of_generation_ids=tuple(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None)),
        add_bos=add_bos, add_eos=add_eos, chat_template=template)


def build_tokenizer(vocab: GgufVocab, path: Path) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` that gives llama.cpp's ids for `vocab`: byte-level BPE
    over the file's merges, llama.cpp's pre-tokenizer regexes, control and unknown tokens
    as special added tokens (matched whole in text, skipped when decoding without special
    tokens), user-defined ones as plain added tokens (matched whole, always decoded)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    token_ids: dict[str, int] = {}
    for token_id, token in enumerate(vocab.tokens):
        token_ids[token] = token_id  # a repeated spelling maps to its last id, as in llama.cpp
    try:
        bpe = models.BPE(vocab=token_ids, merges=list(vocab.merges), unk_token=vocab.text(vocab.unk_id),
                         fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # the Rust binding raises a bare Exception
        raise CheckpointError(f"{path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {exc}") from exc
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[vocab.pre])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(vocab, path)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in _tokens_of_types(vocab, (CONTROL, UNKNOWN))])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token in _tokens_of_types(vocab, (USER_DEFINED,))])
    return tokenizer


def tokenizer_config(vocab: GgufVocab, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by text, the BOS/EOS flags and the chat
    template (services/tokenizer/chat.py and transformers read it)."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.text(vocab.bos_id),
        "eos_token": vocab.text(vocab.eos_id),
        "unk_token": vocab.text(vocab.unk_id),
        "pad_token": vocab.text(vocab.pad_id),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": PRE_TOKENIZERS[vocab.pre].clean_spaces,
        "model_max_length": model_max_length,
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return config


# ---------------------------------------------------------------------------- parts


def _pre_tokenizer(spec: PreTokenizer) -> tokenizers.pre_tokenizers.PreTokenizer:
    from tokenizers import Regex, pre_tokenizers

    # ByteLevel's own regex is the GPT-2 one llama.cpp applies last.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if not spec.isolate:
        return byte_level
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(pattern), behavior="isolated")
                                      for pattern in spec.isolate), byte_level])


def _post_processor(vocab: GgufVocab, path: Path) -> tokenizers.processors.PostProcessor:
    from tokenizers import processors

    if not (vocab.add_bos or vocab.add_eos):
        return processors.ByteLevel(trim_offsets=False)
    bos = [(vocab.tokens[vocab.bos_id], vocab.bos_id)] if vocab.add_bos and vocab.bos_id is not None else []
    eos = [(vocab.tokens[vocab.eos_id], vocab.eos_id)] if vocab.add_eos and vocab.eos_id is not None else []
    # Templates as lists of pieces: a token's text may hold spaces.
    single = [*(text for text, _ in bos), "$A", *(text for text, _ in eos)]
    pair = [*single, *(text for text, _ in bos), "$B:1", *(text for text, _ in eos)]
    try:
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(bos + eos)))
    except ValueError as exc:  # e.g. a ':' in the token's text, which templates cannot hold
        raise CheckpointError(f"{path}: cannot add the BOS/EOS tokens {[text for text, _ in bos + eos]} "
                              f"as tokenizer.ggml.add_bos_token/add_eos_token ask: {exc}") from exc


def _tokens_of_types(vocab: GgufVocab, types: Sequence[int]) -> list[str]:
    return [token for token, kind in zip(vocab.tokens, vocab.token_types) if kind in types]


def _merges(meta: Mapping[str, Any], path: Path) -> tuple[tuple[str, str], ...]:
    """Each merge "left right" split at its first space after the first character, as
    llama.cpp splits it (a left part may itself be a space in non-byte-level spellings)."""
    merges = []
    for index, merge in enumerate(_str_list(meta, "tokenizer.ggml.merges", path)):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges[{index}] {merge!r} is not two tokens "
                                  f"separated by a space")
        merges.append((merge[:cut], merge[cut + 1:]))
    return tuple(merges)


def _token_types(meta: Mapping[str, Any], count: int, path: Path) -> tuple[int, ...]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return (NORMAL,) * count
    if not isinstance(types, list) or len(types) != count:
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type must list one type per token ({count})")
    bad = next((i for i, kind in enumerate(types) if kind not in TOKEN_TYPES), None)
    if bad is not None:
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type[{bad}] is {types[bad]!r}, not a llama.cpp "
                              f"token type (1-6)")
    return tuple(types)


def _token_id(meta: Mapping[str, Any], key: str, count: int, path: Path) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
        raise CheckpointError(f"{path}: metadata {key} is {value!r}, not a token id below {count}")
    return value


def _str(meta: Mapping[str, Any], key: str, path: Path) -> str:
    value = meta.get(key)
    if not isinstance(value, str):
        raise CheckpointError(f"{path}: metadata {key} " + ("is missing" if value is None else "must be a string"))
    return value


def _str_list(meta: Mapping[str, Any], key: str, path: Path) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise CheckpointError(f"{path}: metadata {key} " + ("is missing" if value is None
                                                            else "must be a non-empty list of strings"))
    return value


def _bool(meta: Mapping[str, Any], key: str, path: Path, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: metadata {key} must be a boolean, got {value!r}")
    return value
