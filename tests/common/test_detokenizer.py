"""IncrementalDetokenizer: streamed text adds up to the full decode, multi-byte characters
split across tokens (and across the prompt and the output) included, on the default
model's byte-level tokenizer and on a byte-fallback one; stop strings cut the text."""
from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from tokenizers.decoders import DecodeStream

from common.detokenizer import IncrementalDetokenizer
from common.engine.checkpoint import load_tokenizer

MULTI_BYTE = "Hello world 😀 你好，世界 — naïve café 🚀🎉 日本語のテキスト"


@pytest.fixture(scope="module")
def default_tokenizer(tiny_model_dir) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-style: a few word pieces, every other byte as a <0xNN> token, and a decoder
    that strips the first leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "▁a", "a", "b", "▁b", "▁hello", "▁world", "x", "y", "▁x"):
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tokenizer


def stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], stop: tuple[str, ...] = ()) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop)
    return [detokenizer.push(token_id) for token_id in output]


def output_text(tokenizer: Tokenizer, ids: list[int], cut: int) -> str:
    """What ids[cut:] add to the text of ids[:cut]: the full decode past the prompt's
    last complete character (one the prompt starts and the output ends is the output's)."""
    complete = max(end for end in range(cut + 1) if not tokenizer.decode(ids[:end]).endswith("\ufffd"))
    return tokenizer.decode(ids)[len(tokenizer.decode(ids[:complete])):]


@pytest.mark.parametrize("name", ["default_tokenizer", "byte_fallback_tokenizer"])
def test_streamed_text_is_the_full_decode_wherever_the_prompt_ends(name, request):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(MULTI_BYTE, add_special_tokens=False).ids
    assert len(ids) > len(MULTI_BYTE)  # characters do split across tokens
    assert "".join(stream(tokenizer, [], ids)) == tokenizer.decode(ids) == MULTI_BYTE
    for cut in range(len(ids)):  # the prompt ends at every token, mid-character included
        assert "".join(stream(tokenizer, ids[:cut], ids[cut:])) == output_text(tokenizer, ids, cut), cut


def test_a_split_character_comes_out_once_it_is_complete(default_tokenizer):
    ids = default_tokenizer.encode("x🙂y", add_special_tokens=False).ids
    assert len(ids) == 6  # x, the emoji's four bytes, y
    assert stream(default_tokenizer, [], ids) == ["x", "", "", "", "🙂", "y"]
    # The prompt starts the emoji and the output ends it: it is the output's, the x is not.
    assert stream(default_tokenizer, ids[:3], ids[3:]) == ["", "🙂", "y"]


def test_the_prompt_s_last_tokens_only_give_the_output_its_leading_space(default_tokenizer):
    prompt = default_tokenizer.encode("Hello", add_special_tokens=False).ids
    output = default_tokenizer.encode(" world", add_special_tokens=False).ids
    assert "".join(stream(default_tokenizer, prompt, output)) == " world"


def test_special_tokens_are_skipped(default_tokenizer):
    ids = default_tokenizer.encode("ab", add_special_tokens=False).ids
    assert "".join(stream(default_tokenizer, [1], [ids[0], 0, ids[1], 1])) == "ab"


def test_a_rewritten_byte_run_restarts_the_stream_instead_of_failing(byte_fallback_tokenizer):
    # Byte tokens that decode to a character, then a byte that makes their run invalid:
    # DecodeStream refuses the step (the released "é" would become U+FFFDs).
    ids = [3 + 0xC3, 3 + 0xA9, 3 + 0xA9, byte_fallback_tokenizer.token_to_id("x")]
    raw = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for token_id in ids:
            raw.step(byte_fallback_tokenizer, token_id)
    deltas = stream(byte_fallback_tokenizer, [], ids)
    assert deltas[:2] == ["", "é"] and "".join(deltas).endswith("x")


def test_find_stop_cuts_the_text_at_a_stop_string_split_across_tokens(default_tokenizer):
    ids = default_tokenizer.encode("say 你好 then more", add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(default_tokenizer, [], stop=("你好", "never"))
    pushed = 0
    for token_id in ids:
        pushed += 1
        found = detokenizer.find_stop(detokenizer.push(token_id))
        if found is not None:
            break
    assert found == "你好" and pushed < len(ids)  # found at the token that completed it
    assert default_tokenizer.decode(ids[:pushed]).endswith("你好")
    assert detokenizer.text == "say "
