"""GGUF checkpoints: converted once into a Hugging Face checkpoint directory in the cache,
every supported tensor type dequantized exactly, everything else refused by name, and the
engine on the SmolLM2 Q4_1 file greedy-decoding what transformers' own GGUF loader does."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from common.atomic_dir import cached_dir
from common.config import load_config
from common.engine.checkpoint import (
    CheckpointError,
    fingerprints,
    load_model_config,
    load_state_dict,
    load_tokenizer,
)
from common.engine.gguf import (
    BLOCK_BYTES,
    BLOCKS_FILE,
    CONVERSION_VERSION,
    SUPPORTED_TENSOR_TYPES,
    WeightBlocks,
    check_gguf,
    checkpoint_dir,
    convert_gguf,
    file_digest,
    read_weight_blocks,
    unpermute_qk,
)
from tests.common.engine.gguf_files import TinyGguf, llama_cpp_permute, metadata_setter, smollm2_file

Q = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parents[3]


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _widened(blocks: WeightBlocks) -> np.ndarray:
    """scale * q + minimum per block of 32 along K, in float32."""
    rows, cols = blocks.q.shape
    q = blocks.q.astype(np.float32).reshape(rows, cols // 32, 32)
    scale = blocks.scale.astype(np.float32)[..., None]
    minimum = blocks.minimum.astype(np.float32)[..., None]
    if blocks.bits == 4:
        assert blocks.q.min() >= 0 and blocks.q.max() <= 15
    return (scale * q + minimum).reshape(rows, cols)


def _refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as caught:
        convert_gguf(path, path.parent / "out")
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    assert not (path.parent / "out").exists() and not list(path.parent.glob(".out.tmp-*"))
    return message


# ------------------------------------------------------------------- q/k row order


def _rope_halves(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Hugging Face's RoPE on (positions, head_dim) rows: dimension i turns with i + d/2."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * base ** (-np.arange(half) / half)
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = x[:, :half], x[:, half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _rope_pairs(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's RoPE for llama: dimensions 2i and 2i+1 turn together."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * base ** (-np.arange(half) / half)
    cos, sin = np.cos(angles), np.sin(angles)
    even, odd = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = even * cos - odd * sin, odd * cos + even * sin
    return out


@pytest.mark.parametrize("heads, head_dim", [(4, 16), (3, 64), (1, 8)])
def test_unpermute_inverts_llama_cpp_permutation(heads: int, head_dim: int) -> None:
    rng = np.random.default_rng(heads)
    weight = rng.normal(size=(heads * head_dim, 24)).astype(np.float32)
    permuted = llama_cpp_permute(weight, heads)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_qk(permuted, heads), weight)
    # Why it is the right order: llama.cpp's pairwise RoPE on the permuted projection is
    # Hugging Face's half-split RoPE on the original, rows reordered the same way.
    hidden = rng.normal(size=(5, 24)).astype(np.float32)
    positions = np.arange(5, dtype=np.float64) * 7
    for head in range(heads):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        hf = _rope_halves(hidden @ weight[rows].T, positions, 10000.0)
        cpp = _rope_pairs(hidden @ permuted[rows].T, positions, 10000.0)
        assert np.allclose(unpermute_qk(cpp.T, 1).T, hf, atol=1e-5)


# ---------------------------------------------------------------------- conversion


@pytest.mark.parametrize("qtype", SUPPORTED_TENSOR_TYPES)
def test_every_supported_type_converts_to_the_dequantized_weights(tmp_path: Path, qtype: str) -> None:
    spec = TinyGguf(qtype=Q[qtype], seed=len(qtype))
    out = convert_gguf(spec.write(tmp_path / "tiny.gguf"), tmp_path / "out")
    weights, expected = _weights(out), spec.expected()
    assert sorted(weights) == sorted(expected)
    for name, weight in weights.items():
        assert weight.dtype == np.float32 and np.array_equal(weight, expected[name]), name
    if qtype == "F32":  # lossless: the un-permuted q/k are exactly the weights the file was made from
        assert all(np.array_equal(weights[name], weight) for name, weight in spec.hf_weights().items())
    blocks = read_weight_blocks(out)
    if qtype in BLOCK_BYTES:  # kept as stored too: the blocks give the dequantized weights' very bits
        assert sorted(blocks) == sorted(name for name, weight in weights.items() if weight.ndim == 2)
        for name, kept in blocks.items():
            assert kept.bits == (4 if qtype in ("Q4_0", "Q4_1") else 8)
            assert np.array_equal(_widened(kept), weights[name]), name
    else:
        assert blocks == {} and not (out / BLOCKS_FILE).exists()
    assert load_model_config(out) == dataclasses.replace(spec.config(), bos_token_id=0, eos_token_ids=(1,),
                                                         torch_dtype="float32")


def test_the_converted_directory_is_an_ordinary_checkpoint(tmp_path: Path) -> None:
    spec = TinyGguf(qtype=Q.Q8_0, tied=True)
    out = convert_gguf(spec.write(tmp_path / "tiny.gguf"), tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "gguf_blocks.st", "gguf_source.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    cfg = load_model_config(out)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in _weights(out)
    state = load_state_dict(out, cfg)  # the engine's loader, torch tensors
    assert np.array_equal(state["model.layers.1.self_attn.k_proj.weight"].numpy(),
                          spec.expected()["model.layers.1.self_attn.k_proj.weight"])
    assert load_tokenizer(out).encode("hello").ids[0] == 0  # add_bos_token: <s> first
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>" and config["add_bos_token"] is True
    assert "<|im_start|>" in config["chat_template"]
    assert check_gguf(tmp_path / "tiny.gguf") == cfg


def test_large_conversions_are_written_in_shards_with_an_index(tmp_path: Path) -> None:
    spec = TinyGguf(qtype=Q.Q4_0)
    out = convert_gguf(spec.write(tmp_path / "tiny.gguf"), tmp_path / "out", max_shard_bytes=200_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    state = load_state_dict(out, load_model_config(out))
    expected = spec.expected()
    assert all(np.array_equal(state[name].numpy(), expected[name]) for name in expected)


def test_rope_and_norm_metadata_reach_the_config(tmp_path: Path) -> None:
    spec = TinyGguf(rope_theta=500000.0, rms_eps=1e-6, extra_metadata=metadata_setter(
        llama__rope__scaling__type="linear", llama__rope__scaling__factor=4.0, tokenizer__ggml__eot_token_id=3))
    cfg = load_model_config(convert_gguf(spec.write(tmp_path / "tiny.gguf"), tmp_path / "out"))
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == pytest.approx(1e-6)
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 4.0)
    assert cfg.eos_token_ids == (1, 3) and cfg.max_position_embeddings == 2048


# ------------------------------------------------------------------------ refusals


def test_a_type_baton_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    rows = np.random.default_rng(0).integers(0, 256, size=(128, 210), dtype=np.uint8)  # Q6_K: 210 B/256
    spec = TinyGguf(raw_tensors={"blk.0.ffn_down.weight": (rows, Q.Q6_K)})
    message = _refusal(spec.write(tmp_path / "q6k.gguf"))
    assert "tensor blk.0.ffn_down.weight has type Q6_K, which Baton does not read; supported: F32, F16" in message


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = TinyGguf().write(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-1000])
    assert "truncated or damaged GGUF file" in _refusal(path)
    path.write_bytes(b"GGUF\x03\x00")
    assert "truncated GGUF file: 6 bytes" in _refusal(path)


def test_a_damaged_header_is_refused(tmp_path: Path) -> None:
    data = TinyGguf().write(tmp_path / "tiny.gguf").read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUZ" + data[4:])
    assert "not a GGUF file (it starts with b'GGUZ'" in _refusal(path)
    path.write_bytes(data[:4] + (99).to_bytes(4, "little") + data[8:])
    assert "GGUF version 99, which Baton does not read (readable: 2, 3)" in _refusal(path)
    path.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    assert "a big-endian GGUF file, which Baton does not read" in _refusal(path)
    path.write_bytes(data[:16] + (10**6).to_bytes(8, "little") + data[24:])  # far more keys than there are
    assert "truncated or damaged GGUF file" in _refusal(path)
    path.write_text('{"not": "gguf"}')
    assert "not a GGUF file" in _refusal(path)


def test_what_is_not_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        checkpoint_dir(tmp_path / "missing.gguf", tmp_path / "cache")
    (tmp_path / "dir.gguf").mkdir()
    assert checkpoint_dir(tmp_path / "dir.gguf", tmp_path / "cache") == tmp_path / "dir.gguf"  # a directory
    with pytest.raises(CheckpointError, match="not a file"):
        convert_gguf(tmp_path / "dir.gguf", tmp_path / "out")


def test_a_model_that_is_not_llama_is_refused_by_name(tmp_path: Path) -> None:
    message = _refusal(TinyGguf(architecture="gpt2").write(tmp_path / "gpt2.gguf"))
    assert "architecture 'gpt2' (general.architecture), which Baton does not read from GGUF; " \
           "supported: llama" in message


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    assert "pre-tokenizer 'qwen2' (tokenizer.ggml.pre), which Baton does not read; supported: gpt-2, smollm" \
        in _refusal(TinyGguf(pre="qwen2").write(tmp_path / "qwen.gguf"))
    assert "pre-tokenizer 'default' (no tokenizer.ggml.pre)" \
        in _refusal(TinyGguf(pre=None).write(tmp_path / "none.gguf"))


def test_unsupported_rope_and_shapes_are_refused(tmp_path: Path) -> None:
    yarn = TinyGguf(extra_metadata=metadata_setter(llama__rope__scaling__type="yarn"))
    assert "RoPE scaling 'yarn' (llama.rope.scaling.type), which Baton does not support" \
        in _refusal(yarn.write(tmp_path / "yarn.gguf"))
    lying = TinyGguf(raw_tensors={"blk.1.ffn_up.weight": (np.zeros((128, 128), np.float32), Q.F32)})
    assert "tensor blk.1.ffn_up.weight has shape (128, 128), but the metadata asks for (256, 128)" \
        in _refusal(lying.write(tmp_path / "shape.gguf"))
    split = TinyGguf(extra_metadata=metadata_setter(split__count=3))
    assert "one part of a GGUF file split in 3 (split.count)" in _refusal(split.write(tmp_path / "split.gguf"))
    missing = TinyGguf(drop=("blk.1.ffn_norm.weight",))
    assert "missing tensor blk.1.ffn_norm.weight for the metadata's 2-layer model" \
        in _refusal(missing.write(tmp_path / "missing.gguf"))
    extra = TinyGguf(raw_tensors={"blk.2.attn_q.weight": (np.zeros((128, 128), np.float32), Q.F32)})
    assert "unexpected tensor blk.2.attn_q.weight for a 2-layer llama model" \
        in _refusal(extra.write(tmp_path / "extra.gguf"))


# ---------------------------------------------------------------------------- cache


def test_the_second_start_reuses_the_conversion(tmp_path: Path) -> None:
    path = TinyGguf(qtype=Q.Q5_1).write(tmp_path / "tiny.gguf")
    conversions: list[tuple[Path, Path]] = []
    first = checkpoint_dir(path, tmp_path / "cache", on_convert=lambda *where: conversions.append(where))
    assert first == tmp_path / "cache" / "gguf" / f"{file_digest(path)}-v{CONVERSION_VERSION}"
    assert conversions == [(path, first)]
    stamps = {p.name: p.stat().st_mtime_ns for p in [first, *first.iterdir()]}
    assert checkpoint_dir(str(path), tmp_path / "cache", on_convert=lambda *where: conversions.append(where)) \
        == first
    assert len(conversions) == 1
    assert {p.name: p.stat().st_mtime_ns for p in [first, *first.iterdir()]} == stamps
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary directory left
    # The same bytes under another name share the conversion; other bytes get their own.
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    assert checkpoint_dir(copy, tmp_path / "cache") == first
    assert checkpoint_dir(TinyGguf(seed=5).write(tmp_path / "other.gguf"), tmp_path / "cache") != first


def test_a_loser_of_the_race_uses_the_winners_copy(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "gguf" / "x-v1"
    winner = TinyGguf()

    def build_while_another_process_wins(tmp_dir: Path) -> None:
        convert_gguf(winner.write(tmp_path / "w.gguf"), out)  # the other process renames first
        (tmp_dir / "config.json").write_text("{}")

    assert cached_dir(out, build_while_another_process_wins) == out
    assert load_model_config(out).num_layers == 2  # the winner's complete copy, not ours
    assert [p.name for p in out.parent.iterdir()] == ["x-v1"]


CONVERT_WHEN_TOLD = """
import sys, time
from pathlib import Path
from common.engine.gguf import checkpoint_dir
from common.engine.checkpoint import fingerprints
go = Path(sys.argv[3])
Path(sys.argv[4]).touch()
while not go.exists():
    time.sleep(0.001)
model_dir = checkpoint_dir(Path(sys.argv[1]), Path(sys.argv[2]))
print("RESULT", model_dir, *fingerprints(model_dir))
"""


def test_two_processes_converting_at_once_end_with_the_same_good_directory(tmp_path: Path) -> None:
    path = TinyGguf(qtype=Q.Q4_1, layers=4).write(tmp_path / "tiny.gguf")
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    children = [subprocess.Popen([sys.executable, "-c", CONVERT_WHEN_TOLD, str(path), str(cache), str(go),
                                  str(tmp_path / f"ready-{i}")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=REPO) for i in range(2)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start converting now
    outputs = [child.communicate(timeout=60) for child in children]
    assert all(child.returncode == 0 for child in children), outputs
    results = {line for stdout, _ in outputs for line in stdout.splitlines() if line.startswith("RESULT ")}
    assert len(results) == 1  # the same directory and the same fingerprints
    model_dir = Path(results.pop().split()[1])
    assert [p.name for p in (cache / "gguf").iterdir()] == [model_dir.name]
    assert load_model_config(model_dir).num_layers == 4
    assert fingerprints(model_dir) == fingerprints(convert_gguf(path, tmp_path / "again"))


# ------------------------------------------------------------------------------ svc


def test_the_model_setting_takes_a_gguf_file(tmp_path: Path) -> None:
    path = TinyGguf().write(tmp_path / "tiny.gguf")
    assert load_config(env={}, overrides={"model": str(path)}).model == str(path)


def test_svc_checks_a_gguf_model_without_converting_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import main

    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    good = TinyGguf().write(tmp_path / "tiny.gguf")
    done = CliRunner().invoke(main, ["start", "tokenizer", "--model", str(good), "--check-config"])
    assert done.exit_code == 0 and "config ok for tokenizer" in done.output, done.output
    assert not (tmp_path / "cache" / "gguf").exists()
    bad = TinyGguf(pre="falcon").write(tmp_path / "falcon.gguf")
    done = CliRunner().invoke(main, ["start", "worker", "--model", str(bad), "--check-config"])
    assert done.exit_code != 0 and f"config: model: {bad}: pre-tokenizer 'falcon'" in done.output


def test_svc_generate_runs_a_gguf_file(tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import main

    monkeypatch.setenv("BATON_CACHE_DIR", str(fresh_cache))
    path = TinyGguf(qtype=Q.Q8_0).write(tmp_path / "tiny.gguf")
    done = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "4",
                                     "--ignore-eos", "--dtype", "float32", "--kv-cache-gb", "0.01", "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.output.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 4 and result["prompt_token_ids"][0] == 0
    assert (fresh_cache / "gguf" / f"{file_digest(path)}-v{CONVERSION_VERSION}").is_dir()


# ------------------------------------------------------------------------ SmolLM2


PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 * 23? Show your steps.",
    "Give me a haiku about the sea.",
    "Summarize the plot of Hamlet in one paragraph.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, Path]:
    """(the GGUF file, its converted directory in this run's cache)."""
    path = smollm2_file()
    return path, checkpoint_dir(path)


def test_smollm2_converts_to_its_documented_shape(smollm2: tuple[Path, Path]) -> None:
    _, model_dir = smollm2
    cfg = load_model_config(model_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) \
        == (30, 576, 9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (100000.0, 8192, True)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


@pytest.fixture
def one_torch_thread():
    """~600 forward passes of a 135M model on one torch thread: on this project's 2-core
    machines, while other processes hold a core, two threads took ten times as long
    (each waits at every barrier for the other, preempted), one thread about a minute."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_smollm2_greedy_tokens_equal_transformers_gguf_load(smollm2: tuple[Path, Path], test_device: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.sampling_params import SamplingParams
    from services.tokenizer.chat import ChatTemplate

    path, model_dir = smollm2
    template, tokenizer = ChatTemplate.from_model_dir(model_dir), load_tokenizer(model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = []
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode(template.text_for_tokenizer(template.render(messages), False)).ids
        assert ids == list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                            tokenize=True, return_dict=False))
        prompts.append(ids)
    engine = Engine(EngineConfig(model_dir=model_dir, dtype="float32", device=test_device, kv_cache_gb=0.25,
                                 max_model_len=1024))
    baton = [result.token_ids for result in engine.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))]
    del engine
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, baton, strict=True):
        with torch.inference_mode():
            # An explicit mask: generate() would otherwise mask every <|im_end|>, the pad token.
            output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)
        assert tokens == output[0, len(prompt):].tolist(), tokenizer.decode(prompt)


def test_a_conversion_loads_no_torch(tmp_path: Path) -> None:
    """The tokenizer and kvstore roles, which have no torch, convert GGUF files too."""
    path = TinyGguf(qtype=Q.Q4_0).write(tmp_path / "tiny.gguf")
    code = ("import sys; from pathlib import Path; from common.engine.gguf import checkpoint_dir; "
            f"checkpoint_dir(Path({str(path)!r}), Path({str(tmp_path / 'cache')!r})); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
