"""The tokenizer of a GGUF file, rebuilt for `tokenizers`: llama.cpp's pre-tokenizers, its
special tokens, and transformers' own GGUF tokenizer's ids on SmolLM2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.engine.checkpoint import CheckpointError, load_tokenizer
from common.engine.default_model import build_tokenizer
from common.engine.gguf import checkpoint_dir, convert_gguf
from tests.common.engine.gguf_files import USER_DEFINED, TinyGguf, smollm2_file

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines  \n\n\t end",
    "héllo wörld, 12345 apples and 6.02e23 atoms",
]


def _tokenizer(spec: TinyGguf, tmp_path: Path, name: str = "tiny"):
    return load_tokenizer(convert_gguf(spec.write(tmp_path / f"{name}.gguf"), tmp_path / name))


def test_gpt2_pre_tokenizer_tokenizes_as_the_byte_level_bpe_it_was_made_from(tmp_path: Path) -> None:
    spec = TinyGguf(pre="gpt-2", add_bos=True)
    converted, original = _tokenizer(spec, tmp_path), build_tokenizer(spec.vocab_size - 1, spec.seed)
    for text in TEXTS:
        assert converted.encode(text).ids == original.encode(text).ids, text
        assert converted.decode(converted.encode(text).ids) == text


def _pieces(tokenizer, text: str) -> list[str]:
    """The text of each piece the pre-tokenizer cuts `text` into."""
    return [text[start:end] for _, (start, end) in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_smollm_pre_tokenizer_isolates_every_numeric_character(tmp_path: Path) -> None:
    merges = (("1", "2"),)  # "12" is one token wherever digits are not isolated
    smollm = _tokenizer(TinyGguf(pre="smollm", extra_merges=merges), tmp_path, "smollm")
    gpt2 = _tokenizer(TinyGguf(pre="gpt-2", extra_merges=merges), tmp_path, "gpt2")
    text = "abc 1234 x12 ٣٤ ½ and 12"  # Arabic-Indic digits, a vulgar fraction
    assert _pieces(gpt2, text) == ["abc", " 1234", " x", "12", " ٣٤", " ½", " and", " 12"]
    assert _pieces(smollm, text) == ["abc", " ", "1", "2", "3", "4", " x", "1", "2", " ", "٣", "٤",
                                     " ", "½", " and", " ", "1", "2"]
    assert "12" in gpt2.encode(text).tokens and "12" not in smollm.encode(text).tokens


def test_control_tokens_are_special_and_user_defined_ones_are_text(tmp_path: Path) -> None:
    tokenizer = _tokenizer(TinyGguf(add_bos=False), tmp_path)
    think = tokenizer.token_to_id(USER_DEFINED)
    ids = tokenizer.encode(f"</s>hi{USER_DEFINED}x<pad>").ids
    assert ids[0] == 1 and think in ids and ids[-1] == 3  # each matched whole
    assert tokenizer.decode(ids) == f"hi{USER_DEFINED}x"  # special tokens skipped, user-defined kept
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"</s>hi{USER_DEFINED}x<pad>"
    assert tokenizer.encode("hi").ids == tokenizer.encode("hi", add_special_tokens=False).ids  # no BOS


def test_a_sentencepiece_vocabulary_is_refused_by_name(tmp_path: Path) -> None:
    path = TinyGguf(tokenizer_model="llama").write(tmp_path / "spm.gguf")
    with pytest.raises(CheckpointError) as caught:
        convert_gguf(path, tmp_path / "out")
    assert str(caught.value) == (f"{path}: tokenizer model 'llama' (tokenizer.ggml.model), which Baton does not "
                                 f"read; supported: gpt2")


# ------------------------------------------------------------------------ SmolLM2


SMOLLM2_TEXTS = [
    "Hello world! 123",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "Numbers: 0 7 42 1234567890 3.14159 -2.5e-3 1,000,000 ٣٤٥ ½ ² Ⅻ",
    "  multiple   spaces\t\ttabs \t mixed\n\n\nnewlines \n \n  trailing   ",
    "Café déjà vu, naïve façade, Größe, señor, ångström, Łódź",
    "Привет, как дела? Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε· ελληνικά γράμματα αβγδ",
    "你好，世界！日本語のテキスト、한국어 텍스트",
    "مرحبا بالعالم، هذا نص عربي",
    "नमस्ते दुनिया, यह हिन्दी पाठ है।",
    "Emoji: 🎉🚀 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>baton<file_sep>main.py\n<jupyter_code>print(1)",
    "It's they're we've I'm you'll he'd 'quoted' don't",
    "",
    " ",
    "\n",
]


NUMERALS = SMOLLM2_TEXTS[3]


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    """Baton's tokenizer of the converted SmolLM2 file; transformers' tokenizer from the
    file; and the latter with the pre-tokenizer of SmolLM2's own tokenizer.json (every
    numeric character a piece of its own, then GPT-2's byte-level split), which
    transformers does not set for `tokenizer.ggml.pre = smollm` (it keeps GPT-2's)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    path = smollm2_file()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    published = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    published.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return load_tokenizer(checkpoint_dir(path)), hf, published


def test_smollm2_ids_equal_transformers_gguf_tokenizer(smollm2_tokenizers) -> None:
    baton, hf, published = smollm2_tokenizers
    differ = []
    for text in SMOLLM2_TEXTS:
        ids = baton.encode(text).ids
        assert ids == published.encode(text), text
        if ids != hf.encode(text):
            differ.append(text)
        assert baton.decode(ids, skip_special_tokens=False) == text
        assert baton.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    # Only where a space precedes a numeral other than 0-9 (" ٣", " ½", " ²", " Ⅻ"):
    # transformers' GGUF loader merges the space into it, llama.cpp and SmolLM2 do not.
    assert differ == [NUMERALS]
    assert baton.encode(" \u00bd").ids == [216, 16738] and hf.encode(" \u00bd") == [3351, 138]


def test_smollm2_splits_digits_and_keeps_its_specials_whole(smollm2_tokenizers) -> None:
    baton, _, _ = smollm2_tokenizers
    # llama.cpp's smollm pre-tokenizer: " 123" is a space, then one token per digit.
    assert baton.encode("Hello world! 123").ids == [19556, 905, 17, 216, 33, 34, 35]
    assert baton.encode("<|im_start|>user<|im_end|>").ids == [1, 4093, 2]
    assert baton.decode([1, 4093, 2]) == "user"


def test_smollm2_tokenizer_config_carries_the_chat_template(smollm2_tokenizers) -> None:
    config = json.loads((checkpoint_dir(smollm2_file()) / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False and config["clean_up_tokenization_spaces"] is False
    assert config["chat_template"].startswith("{% for message in messages %}")
