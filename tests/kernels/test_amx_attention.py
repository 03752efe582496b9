"""The AMX chunk attention (kernels/csrc/amx_attention.cpp) against dense causal attention
and against the vector kernel it stands beside."""
import pytest
import torch

from kernels.attention import AttentionInputs, select_backend
from kernels.sdpa_paged import AMX_FRESH_MAX_TOKENS, _Fresh, _Native, amx_chunks_fit
from tests.kernels.test_amx_linear import cpu_has_amx
from tests.kernels.test_native import call_with, paged_problem, reference

CASES = [  # shape [(context, new)], heads, kv_heads, dim, block_size
    ([(2048, 32)], 4, 2, 64, 16),                      # the benchmark's prefix hit: 64 rows per KV head
    ([(0, 1)], 4, 2, 64, 16),                          # one token, no context
    ([(37, 20)], 8, 2, 128, 16),                       # 80 rows: five row tiles; dim 128: two value passes
    ([(40, 7), (3, 1), (100, 33), (16, 16)], 4, 2, 64, 16),  # several chunks, unequal contexts
    ([(50, 3), (21, 3)], 6, 1, 96, 24),                # MQA; dim 96 (a partial value pass); blocks of 24
    ([(300, 5)], 14, 2, 64, 32),                       # Qwen-like group of 7
    ([(1000, 17)], 32, 8, 256, 16),                    # widest head dim, Llama-3-like heads
    ([(9, 4)], 2, 2, 32, 5),                           # no GQA; odd block size
]


@pytest.fixture(scope="module")
def amx_attention(native_kernels):
    if not torch.ops.baton.amx_supported():
        if cpu_has_amx():
            pytest.skip("this CPU has AMX but the OS refuses tile state to the process")
        pytest.skip("no AMX on this CPU: chunks stay with SDPA")
    return torch.ops.baton.amx_paged_attention


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_kernel_matches_dense_causal_attention(amx_attention, case):
    shape, heads, kv_heads, dim, block_size = case
    args, sequences = paged_problem(shape, heads, kv_heads, dim, block_size, torch.bfloat16)
    out = torch.empty(args[0].shape, dtype=torch.bfloat16)
    amx_attention(*args, out)
    expected = torch.cat([reference(*seq) for seq in sequences])
    # bf16 weights before the value product, as SDPA's bf16 path: a few bf16 ulps.
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    # and no worse than the vector kernel, which keeps its weights in fp32
    vector = torch.empty_like(out)
    torch.ops.baton.paged_attention(*args, vector)
    assert (out.float() - expected).abs().mean() <= 2 * (vector.float() - expected).abs().mean() + 1e-4


def test_kernel_writes_only_the_rows_of_the_sequences_it_is_given(amx_attention):
    args, sequences = paged_problem([(9, 1), (0, 5), (20, 3)], 4, 2, 64, 16, torch.bfloat16)
    query, key_cache, value_cache, table, starts, lens, contexts, block_size, scale = args
    out = torch.full(query.shape, -7.0, dtype=torch.bfloat16)
    chosen = torch.tensor([0, 2])  # rows 0 and 6..8, not the chunk at rows 1..5
    amx_attention(query, key_cache, value_cache, table[chosen].contiguous(), starts[chosen], lens[chosen],
                  contexts[chosen], block_size, scale, out)
    assert torch.equal(out[1:6], torch.full_like(out[1:6], -7.0))
    torch.testing.assert_close(out[[0, 6, 7, 8]].float(), torch.cat([reference(*sequences[0]),
                                                                     reference(*sequences[2])]), atol=2e-2, rtol=2e-2)


def test_kernel_refuses_bad_input_by_name(amx_attention):
    args, _ = paged_problem([(20, 4)], 4, 2, 64, 16, torch.bfloat16)
    query, table = args[0], args[3]
    out = torch.empty(query.shape, dtype=torch.bfloat16)

    def call(**changed):
        call_with(amx_attention, args, {"out": out, **changed})

    with pytest.raises(RuntimeError, match="query, caches and out: expected bf16"):
        call(query=query.float())
    with pytest.raises(RuntimeError, match="head dim: a multiple of 32"):
        slots = args[1].shape[0]
        call(query=torch.zeros(4, 4, 48, dtype=torch.bfloat16),
             key_cache=torch.zeros(slots, 2, 48, dtype=torch.bfloat16),
             value_cache=torch.zeros(slots, 2, 48, dtype=torch.bfloat16),
             out=torch.empty(4, 4, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(block_table=torch.full_like(table, 10_000))
    with pytest.raises(RuntimeError, match="context longer than its block table"):
        call(context_lens=torch.tensor([200]))
    with pytest.raises(RuntimeError, match="query rows or context length out of range"):
        call(query_lens=torch.tensor([30]))
    with pytest.raises(RuntimeError, match="query, caches and out: expected bf16"):
        call(out=out.float())
    with pytest.raises(RuntimeError, match="out: expected contiguous, query's shape"):
        call(out=out[:2])


def backend_step(shape, heads=4, kv_heads=2, dim=64, block_size=16):
    """One step's batch for the SDPA backend on the pool paged_problem builds (its new
    tokens' K/V are written again by the backend: the same values), and the reference."""
    args, sequences = paged_problem(shape, heads, kv_heads, dim, block_size, torch.bfloat16)
    query, key_cache, value_cache, table = args[:4]
    lens = [new for _, new in shape]
    slots, new_keys, new_values = [], [], []
    for i, ((context, new), (_, keys, values)) in enumerate(zip(shape, sequences)):
        slots += [int(table[i, pos // block_size]) * block_size + pos % block_size
                  for pos in range(context, context + new)]
        new_keys.append(keys[context:])
        new_values.append(values[context:])
    inputs = AttentionInputs(query_starts=[sum(lens[:i]) for i in range(len(lens))], query_lens=lens,
                             context_lens=[c + n for c, n in shape],
                             num_single=next((i for i, (_, n) in enumerate(shape) if n != 1), len(shape)),
                             block_size=block_size, block_table=table, slot_mapping=torch.tensor(slots))
    expected = torch.cat([reference(*seq) for seq in sequences])
    return inputs, query.contiguous(), torch.cat(new_keys), torch.cat(new_values), \
        torch.stack([key_cache, value_cache]), expected


@pytest.mark.parametrize("shape", [
    [(2048, 32)],                                # the prefix hit
    [(40, 1), (3, 1), (0, 9), (100, 33), (16, 16)],  # decode, a fresh prompt, chunks over context
    [(7, 1), (30, 5), (0, 3), (64, 2)],
])
def test_the_sdpa_backend_sends_every_chunk_to_it(amx_attention, shape):
    """Fresh prompts too (up to AMX_FRESH_MAX_TOKENS): on the small model's 1,024-token
    prefills the kernel was ~7% faster end to end than SDPA's flash kernel."""
    inputs, query, key, value, kv_layer, expected = backend_step(shape)
    backend = select_backend("sdpa", torch.device("cpu"), 64, torch.bfloat16)
    assert backend.amx_chunks and backend.native
    metadata = backend.prepare(inputs)
    chunks = [g for g in metadata.groups if isinstance(g, _Native) and g.amx]
    assert len(chunks) == 1 and chunks[0].query_lens.tolist() == [n for c, n in shape if n > 1]
    assert len(metadata.groups) == 1 + (inputs.num_single > 0)  # no SDPA group left
    output = backend.forward(query, key, value, kv_layer, metadata)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_fresh_chunk_past_its_length_limit_stays_with_sdpa(amx_attention):
    shape = [(3, 1), (0, AMX_FRESH_MAX_TOKENS + 1), (64, 2)]
    inputs, query, key, value, kv_layer, expected = backend_step(shape)
    backend = select_backend("sdpa", torch.device("cpu"), 64, torch.bfloat16)
    metadata = backend.prepare(inputs)
    assert [g.query_lens.tolist() for g in metadata.groups if isinstance(g, _Native) and g.amx] == [[2]]
    assert [g.query_len for g in metadata.groups if isinstance(g, _Fresh)] == [AMX_FRESH_MAX_TOKENS + 1]
    output = backend.forward(query, key, value, kv_layer, metadata)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)


def test_fp32_and_odd_head_dims_keep_sdpa_for_chunks(amx_attention):
    assert not select_backend("sdpa", torch.device("cpu"), 64, torch.float32).amx_chunks
    assert not select_backend("sdpa", torch.device("cpu"), 48, torch.bfloat16).amx_chunks
    assert not amx_chunks_fit(torch.device("cuda"), torch.bfloat16, 64)
