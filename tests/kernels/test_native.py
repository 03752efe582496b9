"""Baton's C++ paged attention (kernels/csrc) against dense causal attention, and its loader."""
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.native import native_supports_head_dim
from services.local_cluster import child_env

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def paged_attention(native_kernels):
    return torch.ops.baton.paged_attention


def paged_problem(shape, heads, kv_heads, dim, block_size, dtype, seed=0):
    """Sequences (cached context, new tokens) on a pool with scattered blocks: the kernel's
    arguments, and per sequence its queries and full K/V for the reference."""
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-(context + new) // block_size) for context, new in shape]
    num_blocks = sum(widths) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    # Unwritten slots hold NaN: reading past a sequence's context would show.
    key_cache = torch.full((num_blocks * block_size, kv_heads, dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    tables, sequences = [], []
    for (context, new), width in zip(shape, widths):
        blocks = [free.pop() for _ in range(width)]
        tables.append(blocks + [0] * (max(widths) - width))
        total = context + new
        keys, values = (torch.randn(total, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
        slots = torch.tensor([blocks[pos // block_size] * block_size + pos % block_size for pos in range(total)])
        key_cache[slots], value_cache[slots] = keys, values
        sequences.append((torch.randn(new, heads, dim, generator=generator).to(dtype), keys, values))
    lens = [new for _, new in shape]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    # The query as the model passes it: a view into a wider [tokens, heads + kv_heads, dim] row.
    packed = torch.zeros(sum(lens), heads + kv_heads, dim, dtype=dtype)
    query = packed[:, :heads]
    query.copy_(torch.cat([q for q, _, _ in sequences]))
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    args = (query, key_cache, value_cache, torch.tensor(tables), as_long(starts), as_long(lens),
            as_long([c + n for c, n in shape]), block_size, dim ** -0.5)
    return args, sequences


def reference(query, keys, values):
    """Causal attention in fp32 for one sequence whose last query.shape[0] positions query."""
    group = query.shape[1] // keys.shape[1]
    q, k, v = (x.float().transpose(0, 1) for x in (query, keys, values))
    visible = torch.arange(k.shape[1])[None, :] <= torch.arange(q.shape[1])[:, None] + (k.shape[1] - q.shape[1])
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), attn_mask=visible)
    return out.transpose(0, 1)


CASES = [  # shape [(context, new)], heads, kv_heads, dim, block_size
    ([(0, 1)], 4, 2, 64, 16),                          # one token, no context
    ([(40, 1), (3, 1), (100, 1), (16, 1)], 4, 2, 64, 16),  # decode, unequal contexts
    ([(2048, 32)], 4, 2, 64, 16),                      # a prefix hit: 64 rows per KV head
    ([(37, 20)], 8, 2, 128, 16),                       # 80 rows: three row tiles
    ([(5, 1), (0, 7), (30, 9)], 4, 4, 16, 4),          # no GQA; small blocks
    ([(50, 1), (21, 3)], 6, 1, 80, 24),                # MQA; dim 80; tiles split at blocks
    ([(300, 1)], 14, 2, 64, 32),                       # Qwen-like group of 7
    # A decode batch of 16 (>= 2 items a thread on 8 threads): sequences whose rows for
    # both KV heads fit one item are one, the 9-token query (54 rows) is split by head.
    ([(40, 1), (3, 2), (100, 1), (16, 1), (7, 1), (60, 3), (0, 1), (200, 1), (10, 9), (33, 1), (1, 1), (64, 1),
      (65, 1), (15, 2), (90, 1), (5, 1)], 6, 2, 64, 16),
]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_kernel_matches_dense_causal_attention(paged_attention, case, dtype, tolerance):
    shape, heads, kv_heads, dim, block_size = case
    args, sequences = paged_problem(shape, heads, kv_heads, dim, block_size, dtype)
    out = torch.empty(args[0].shape, dtype=dtype)
    paged_attention(*args, out)
    expected = torch.cat([reference(*seq) for seq in sequences])
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_kernel_writes_only_the_rows_of_the_sequences_it_is_given(paged_attention):
    args, sequences = paged_problem([(9, 1), (0, 5), (20, 1)], 4, 2, 64, 16, torch.float32)
    query, key_cache, value_cache, table, starts, lens, contexts, block_size, scale = args
    out = torch.full(query.shape, -7.0)
    chosen = torch.tensor([0, 2])  # the two decode tokens (rows 0 and 6), not the chunk (rows 1..5)
    paged_attention(query, key_cache, value_cache, table[chosen].contiguous(), starts[chosen], lens[chosen],
                    contexts[chosen], block_size, scale, out)
    assert torch.equal(out[1:6], torch.full_like(out[1:6], -7.0))
    torch.testing.assert_close(out[[0, 6]], torch.cat([reference(*sequences[0]), reference(*sequences[2])]))


def call_with(kernel, args, changed: dict):
    """kernel (paged_attention's signature) on paged_problem's args, those named in
    `changed` (and `out`, which it must name) replaced."""
    query, key_cache, value_cache, table, starts, lens, contexts, block_size, scale = args
    given = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_table=table,
                 query_starts=starts, query_lens=lens, context_lens=contexts)
    given.update(changed)
    kernel(given["query"], given["key_cache"], given["value_cache"], given["block_table"], given["query_starts"],
           given["query_lens"], given["context_lens"], block_size, scale, given["out"])


def test_kernel_refuses_bad_input_by_name(paged_attention):
    args, _ = paged_problem([(9, 1)], 4, 2, 64, 16, torch.float32)
    query, key_cache, value_cache, table = args[:4]
    out = torch.empty(query.shape)

    def call(**changed):
        call_with(paged_attention, args, {"out": out, **changed})

    with pytest.raises(RuntimeError, match="share one dtype"):
        call(key_cache=key_cache.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="key_cache/value_cache"):
        call(value_cache=value_cache.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(RuntimeError, match="context longer than its block table"):
        call(context_lens=torch.tensor([17]))
    with pytest.raises(RuntimeError, match="block 10000 is outside the cache"):
        call(block_table=torch.full_like(table, 10_000))
    with pytest.raises(RuntimeError, match="query_lens"):
        call(query_lens=torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match="head dim"):
        wide, slots = torch.zeros(1, 6, 24), key_cache.shape[0]
        call(query=wide[:, :4], key_cache=torch.zeros(slots, 2, 24), value_cache=torch.zeros(slots, 2, 24),
             out=torch.empty(1, 4, 24))
    assert not native_supports_head_dim(24) and native_supports_head_dim(128)


def load_in_subprocess(tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import torch; from kernels.native import load_native_ops; "
         "from kernels.native import amx_available; print('loaded', load_native_ops()); "
         "print('amx', amx_available(torch.device('cpu'), torch.bfloat16))"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env=child_env(BATON_CACHE_DIR=str(tmp_path), **env))


def test_a_failed_build_warns_once_and_leaves_the_torch_path(tmp_path):
    done = load_in_subprocess(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert done.returncode == 0, done.stderr
    assert "loaded False" in done.stdout and "amx False" in done.stdout
    assert (done.stdout + done.stderr).count("native_kernels_unavailable") == 1


def test_native_kernels_can_be_turned_off(tmp_path):
    done = load_in_subprocess(tmp_path, BATON_NATIVE_KERNELS="0")
    assert "loaded False" in done.stdout and "amx False" in done.stdout
    assert not (tmp_path / "kernels").exists()


def test_a_damaged_build_in_the_cache_is_built_again(tmp_path, native_kernels):
    """...with the system compiler where CXX names one that links libstdc++ statically: a
    library carrying its own C++ runtime loses or crashes on the numbers in its messages."""
    from kernels.native import LIBRARY_NAME, build_folder
    from kernels.toolchain import needed_libraries
    from tests.kernels.test_toolchain import static_runtime_compiler

    folder = build_folder(tmp_path / "cache")
    folder.mkdir(parents=True)
    (folder / f"{LIBRARY_NAME}.so").write_bytes(b"\x7fELF cut short")
    done = load_in_subprocess(tmp_path / "cache", CXX=str(static_runtime_compiler(tmp_path)))
    assert "loaded True" in done.stdout, done.stdout + done.stderr
    assert "native_kernels_rebuilding" in done.stdout + done.stderr
    assert "native_kernels_compiler_replaced" in done.stdout + done.stderr
    assert "libstdc++.so.6" in needed_libraries(folder / f"{LIBRARY_NAME}.so")


def test_every_source_in_csrc_is_built_in_exactly_one_unit(tmp_path):
    from kernels.native import CSRC, write_units

    units = [Path(path).read_text().splitlines() for path in write_units(tmp_path)]
    included = [line.removeprefix('#include "').removesuffix('"') for unit in units for line in unit]
    assert len(units) == 2 and all(units)
    assert sorted(included) == sorted(str(source) for source in CSRC.glob("*.cpp"))
