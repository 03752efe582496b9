"""The embedded default model: deterministic, atomic, and loadable by transformers."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from common.engine.checkpoint import (
    expected_tensors,
    load_model_config,
    load_state_dict,
    load_tokenizer,
)
from common.engine.default_model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SIZES,
    SPECIAL_TOKENS,
    UNK_ID,
    bpe_vocab_and_merges,
    build_tokenizer,
    default_model_dir,
    model_config,
    write_default_model,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "héllo wörld — naïve café, 世界, こんにちは, emoji 🎉🚀, ∑∫√",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("default") / "tiny", "tiny", seed=0)


def _files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_sizes_are_the_documented_ones() -> None:
    tiny, small = SIZES["tiny"], SIZES["small"]
    assert (tiny["hidden_size"], tiny["num_hidden_layers"], tiny["num_attention_heads"],
            tiny["num_key_value_heads"], tiny["vocab_size"], tiny["intermediate_size"]) \
        == (256, 4, 4, 2, 512, 768)
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"],
            small["num_key_value_heads"], small["vocab_size"], small["intermediate_size"]) \
        == (768, 12, 12, 4, 32000, 2048)
    for dims in (tiny, small):
        assert dims["max_position_embeddings"] == 4096
        assert dims["rope_theta"] == 10000.0 and dims["rms_norm_eps"] == 1e-5
        assert dims["model_type"] == "llama" and dims["tie_word_embeddings"] is False
        assert dims["torch_dtype"] == "bfloat16"


def test_writes_a_complete_hf_checkpoint(tiny_dir: Path) -> None:
    assert sorted(p.name for p in tiny_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    # Nothing left behind beside it: the temporary build directory was renamed away.
    assert [p.name for p in tiny_dir.parent.iterdir()] == ["tiny"]


def test_same_seed_gives_identical_files_and_other_seed_differs(
        tiny_dir: Path, tmp_path: Path) -> None:
    again = write_default_model(tmp_path / "again", "tiny", seed=0)
    other = write_default_model(tmp_path / "other", "tiny", seed=1)
    assert _files(again) == _files(tiny_dir)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() != (tiny_dir / "tokenizer.json").read_bytes()
    assert (other / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()


def test_our_loader_reads_it(tiny_dir: Path) -> None:
    cfg = load_model_config(tiny_dir)
    assert cfg == model_config("tiny")
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) \
        == ("llama", 512, 256, 768)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 4, 2, 64)
    assert cfg.rope_scaling.rope_type == "default" and cfg.rope_theta == 10000.0
    assert cfg.bos_token_id == BOS_ID and cfg.eos_token_ids == (EOS_ID,)
    assert not (cfg.attention_bias or cfg.qk_norm or cfg.tie_word_embeddings)

    state = load_state_dict(tiny_dir, cfg)
    expected = expected_tensors(cfg)
    assert list(state) == list(expected)
    for name, tensor in state.items():
        assert tuple(tensor.shape) == expected[name]
        assert tensor.dtype == torch.bfloat16
    assert torch.all(state["model.norm.weight"] == 1)
    embed_std = state["model.embed_tokens.weight"].float().std().item()
    q_std = state["model.layers.0.self_attn.q_proj.weight"].float().std().item()
    down_std = state["model.layers.0.mlp.down_proj.weight"].float().std().item()
    assert embed_std == pytest.approx(1.0, rel=0.05)
    assert q_std == pytest.approx(256 ** -0.5, rel=0.05)
    assert down_std == pytest.approx(768 ** -0.5, rel=0.05)


def test_transformers_loads_config_and_model_unchanged(tiny_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(tiny_dir)
    assert type(hf_cfg).__name__ == "LlamaConfig"
    assert (hf_cfg.hidden_size, hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads,
            hf_cfg.num_key_value_heads, hf_cfg.vocab_size, hf_cfg.intermediate_size) \
        == (256, 4, 4, 2, 512, 768)
    assert hf_cfg.bos_token_id == BOS_ID and hf_cfg.eos_token_id == EOS_ID

    model, info = AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    ours = load_state_dict(tiny_dir, load_model_config(tiny_dir))
    hf_state = model.state_dict()
    for name, tensor in ours.items():
        torch.testing.assert_close(hf_state[name], tensor.float(), rtol=0, atol=0)


def test_logits_have_real_spread(tiny_dir: Path) -> None:
    """Greedy decoding must not hinge on near-ties, or implementations that differ in
    rounding would pick different tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(123)
    prompts = torch.randint(4, 512, (32, 24), generator=generator)
    with torch.no_grad():
        logits = model(prompts).logits[:, -1]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median().item() > 0.05
    assert (gaps > 1e-2).float().mean().item() >= 0.9
    assert logits.std().item() > 0.3


def test_transformers_tokenizer_loads_and_round_trips(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == SPECIAL_TOKENS
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) \
        == (BOS_ID, EOS_ID, UNK_ID, PAD_ID)
    assert tok.model_max_length == 4096
    ours = load_tokenizer(tiny_dir)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text).ids
        assert ids[0] == BOS_ID
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_round_trips_and_covers_the_vocab(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert tok.get_vocab_size() == load_model_config(tiny_dir).vocab_size == 512
    assert [tok.id_to_token(i) for i in range(4)] == list(SPECIAL_TOKENS)
    for text in TEXTS:
        encoding = tok.encode(text)
        assert encoding.ids[0] == BOS_ID
        assert all(0 <= i < 512 for i in encoding.ids)
        assert tok.decode(encoding.ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    for token_id in range(len(SPECIAL_TOKENS), 512):
        assert tok.decode([token_id]) != ""
    # Merges do apply: some printable ASCII compresses below one token per byte.
    sample = "".join(tok.id_to_token(i) for i in range(300, 512) if tok.id_to_token(i).isalnum())
    assert len(tok.encode(sample, add_special_tokens=False).ids) < len(sample.encode())


def test_bpe_vocab_fills_the_model_vocab_exactly() -> None:
    vocab, merges = bpe_vocab_and_merges(32000, seed=0)
    assert len(vocab) == 32000 and sorted(vocab.values()) == list(range(32000))
    assert len(merges) == 32000 - 4 - 256
    assert len(set(merges)) == len(merges)
    assert bpe_vocab_and_merges(32000, seed=0) == (vocab, merges)
    assert build_tokenizer(32000, seed=0).get_vocab_size() == 32000
    with pytest.raises(ValueError, match="smaller"):
        bpe_vocab_and_merges(100, seed=0)


def test_refuses_to_overwrite_a_non_empty_dir(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        write_default_model(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_writes_into_an_existing_empty_dir(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    write_default_model(out)
    assert (out / "model.safetensors").is_file()


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="huge"):
        write_default_model(tmp_path / "m", size="huge")
    assert not any(tmp_path.iterdir())


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import common.engine.default_model as default_model

    def crash(*args: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(default_model, "_write_tokenizer_files", crash)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_default_model(tmp_path / "m")
    assert not any(tmp_path.iterdir())


def test_default_model_dir_writes_once_and_reuses(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  tiny_dir: Path) -> None:
    path = default_model_dir(tmp_path, "tiny", seed=0)
    assert path == tmp_path / "models" / "tiny-seed0"
    assert _files(path) == _files(tiny_dir)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(tmp_path, "tiny", seed=0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime

    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "env-root"))
    assert default_model_dir(size="tiny", seed=0) == tmp_path / "env-root" / "models" / "tiny-seed0"
    assert (tmp_path / "env-root" / "models" / "tiny-seed0" / "config.json").is_file()


def test_default_model_dir_is_safe_under_a_race(tmp_path: Path, tiny_dir: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def worker() -> None:
        barrier.wait()
        try:
            results.append(default_model_dir(tmp_path, "tiny", seed=0))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [tmp_path / "models" / "tiny-seed0"] * 3
    assert _files(results[0]) == _files(tiny_dir)
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-seed0"]


def test_losing_the_rename_race_keeps_the_winners_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import common.engine.default_model as default_model

    target = tmp_path / "models" / "tiny-seed0"
    real_write = default_model._write_checkpoint_files

    def write_then_lose(out_dir: Path, size: str, seed: int) -> None:
        real_write(out_dir, size, seed)
        target.mkdir(parents=True)  # the winner renamed its copy in meanwhile
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(default_model, "_write_checkpoint_files", write_then_lose)
    with pytest.raises(FileExistsError, match="concurrently"):
        write_default_model(target)
    target.joinpath("config.json").unlink()
    target.rmdir()
    assert default_model_dir(tmp_path, "tiny", seed=0) == target
    assert [p.name for p in target.iterdir()] == ["config.json"]  # the winner's, untouched
    assert [p.name for p in target.parent.iterdir()] == ["tiny-seed0"]  # no temp dir left
