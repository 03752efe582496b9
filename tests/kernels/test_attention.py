"""The paged SDPA backend against dense causal attention on the same K/V."""
import importlib
import random
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from kernels.attention import AttentionInputs, select_backend
from kernels.native import load_native_ops
from kernels.sdpa_paged import SdpaPagedBackend

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def reference(q, k, v):
    """Causal attention for one sequence whose last q.shape[0] positions are the queries."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM ** 0.5
    offset = k.shape[0] - q.shape[0]
    causal = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0])[:, None] + offset)
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


SHAPES = [  # (cached context, new tokens) per sequence, in batch order
    [(0, 1)],                            # one decode token, no context
    [(9, 1), (3, 1), (17, 1)],           # decode of unequal contexts
    [(0, 11)],                           # one fresh prompt
    [(5, 1), (0, 7), (12, 6), (3, 9)],   # decode then chunks with and without context
    [(5, 1), (0, 7), (12, 6), (0, 4), (3, 9)],  # fresh chunks between continued ones
    [(9, 5)],                            # one chunk over cached context (a prefix hit)
    [(10, 4), (6, 4)],                   # equal continued chunks, back to back
    [(2, 1), (10, 4), (6, 4)],           # the same after a decode token
    [(0, 5), (0, 5), (0, 5)],            # equal fresh prompts: one batched group
    [(3, 1), (0, 5), (0, 5), (0, 2), (0, 5), (8, 3)],  # runs of equal fresh prompts, split
]


@dataclass
class PagedCase:
    """One step's batch on a paged cache whose earlier context is already written, and the
    dense causal attention every backend must give for it."""

    inputs: AttentionInputs
    query: torch.Tensor
    key: torch.Tensor  # the step's new K and V
    value: torch.Tensor
    kv_layer: torch.Tensor
    expected: torch.Tensor


def paged_case(shape: list[tuple[int, int]]) -> PagedCase:
    generator = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    num_blocks = 64
    kv_layer = torch.zeros(2, num_blocks * BLOCK, KV_HEADS, DIM)
    key_cache, value_cache = kv_layer
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous blocks
    tables, full_keys, full_values = [], [], []
    for context, new in shape:
        total = context + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        tables.append(blocks)
        keys = torch.randn(total, KV_HEADS, DIM, generator=generator)
        values = torch.randn(total, KV_HEADS, DIM, generator=generator)
        for pos in range(context):  # earlier context already in the cache
            slot = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
            key_cache[slot], value_cache[slot] = keys[pos], values[pos]
        full_keys.append(keys)
        full_values.append(values)
    query_lens = [new for _, new in shape]
    query_starts = [sum(query_lens[:i]) for i in range(len(shape))]
    queries = [torch.randn(new, HEADS, DIM, generator=generator) for _, new in shape]
    slots = [tables[i][pos // BLOCK] * BLOCK + pos % BLOCK
             for i, (context, new) in enumerate(shape) for pos in range(context, context + new)]
    width = max(map(len, tables))
    inputs = AttentionInputs(
        query_starts=query_starts, query_lens=query_lens,
        context_lens=[c + n for c, n in shape],
        num_single=sum(1 for _, n in shape if n == 1) if shape[0][1] == 1 else 0,
        block_size=BLOCK,
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots))
    return PagedCase(
        inputs, torch.cat(queries),
        torch.cat([k[c:] for k, (c, _) in zip(full_keys, shape)]),
        torch.cat([v[c:] for v, (c, _) in zip(full_values, shape)]),
        kv_layer,
        torch.cat([reference(q, k, v) for q, k, v in zip(queries, full_keys, full_values)]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decode", ["gqa", "folded", "native"])
def test_sdpa_paged_matches_dense(shape, decode):
    """Decode tokens by SDPA broadcasting grouped heads, by SDPA with them folded (CUDA's
    default), or by the C++ kernel (the CPU's where it builds; tests/kernels/test_native.py
    checks that it does wherever a compiler is)."""
    if decode == "native" and not load_native_ops():
        pytest.skip("the C++ kernel did not build here")
    case = paged_case(shape)
    backend = SdpaPagedBackend(fold_decode=decode == "folded", native=decode == "native")
    output = backend.forward(case.query, case.key, case.value, case.kv_layer, backend.prepare(case.inputs))
    torch.testing.assert_close(output, case.expected, atol=1e-5, rtol=1e-5)


def flash_attn_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=False):
    """flash-attn's documented `flash_attn_varlen_func` contract in plain torch: sequences
    packed back to back (cu_seqlens), grouped-query heads, causal masks aligned to the
    bottom right (query i of a sequence sees keys up to i + len_k - len_q)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1],
                                           cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        keys, values = (x[ks:ke].repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], keys) / q.shape[-1] ** 0.5
        if causal:
            shift = (ke - ks) - (qe - qs)
            visible = torch.arange(ke - ks)[None, :] <= torch.arange(qe - qs)[:, None] + shift
            scores = scores.masked_fill(~visible, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


@pytest.fixture
def flash_paged_on_reference(monkeypatch):
    """kernels.flash_paged imported against flash_attn_varlen_reference, and forgotten
    afterwards (so a machine with flash-attn imports the real one later)."""
    import kernels

    monkeypatch.setitem(sys.modules, "flash_attn",
                        types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_reference))
    saved = sys.modules.pop("kernels.flash_paged", None)
    yield importlib.import_module("kernels.flash_paged")
    sys.modules.pop("kernels.flash_paged", None)
    if saved is None:
        del kernels.flash_paged
    else:
        sys.modules["kernels.flash_paged"] = kernels.flash_paged = saved


@pytest.mark.parametrize("shape", SHAPES)
def test_flash_backend_metadata_matches_dense(shape, flash_paged_on_reference):
    """The flash backend's packing (context slots, cu_seqlens, causal alignment) on the CPU,
    with flash-attn's kernel (CUDA only) replaced by its contract written in torch."""
    case = paged_case(shape)
    backend = flash_paged_on_reference.FlashPagedBackend()
    output = backend.forward(case.query, case.key, case.value, case.kv_layer, backend.prepare(case.inputs))
    torch.testing.assert_close(output, case.expected, atol=1e-5, rtol=1e-5)


def test_sdpa_backend_on_cuda_folds_decode_and_keeps_cudnn_out_for_a_step():
    """Decided from the device alone, so checkable without a GPU: cuDNN's attention plans
    every new shape, and decode brings one each step."""
    cuda, cpu = SdpaPagedBackend(torch.device("cuda")), SdpaPagedBackend(torch.device("cpu"))
    assert cuda.fold_decode and not cpu.fold_decode
    with cuda.step_scope():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the step
    with cpu.step_scope():
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_auto_selects_sdpa_without_cuda():
    assert select_backend("auto", torch.device("cpu"), 64, torch.float32).name == "sdpa"
    assert select_backend("auto", torch.device("cpu"), 64, torch.float32).native == load_native_ops()
    assert not select_backend("auto", torch.device("cpu"), 24, torch.float32).native  # a head dim the kernel lacks
    with pytest.raises(RuntimeError, match="flash-attn"):
        select_backend("flash", torch.device("cpu"), 64, torch.float32)


def test_decode_mirror_gives_a_fresh_backends_output_step_after_step():
    """The SDPA backend's decode mirror (appends while the same sequences decode, rebuilds
    when the group changes) attends exactly as a backend without one."""
    generator = torch.Generator().manual_seed(1)
    num_blocks = 1024  # the mirror may take an eighth of the pool
    kv_layer = torch.zeros(2, num_blocks * BLOCK, KV_HEADS, DIM)
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    tables: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}

    def admit(key: int, context: int) -> None:
        tables[key] = [free.pop() for _ in range(-(-(context + 16) // BLOCK))]
        lengths[key] = context
        for pos in range(context):
            slot = tables[key][pos // BLOCK] * BLOCK + pos % BLOCK
            kv_layer[0, slot] = torch.randn(KV_HEADS, DIM, generator=generator)
            kv_layer[1, slot] = torch.randn(KV_HEADS, DIM, generator=generator)

    def decode_inputs(keys: list[int]) -> AttentionInputs:
        width = max(len(tables[k]) for k in keys)
        slots = [tables[k][lengths[k] // BLOCK] * BLOCK + lengths[k] % BLOCK for k in keys]
        return AttentionInputs(
            query_starts=list(range(len(keys))), query_lens=[1] * len(keys),
            context_lens=[lengths[k] + 1 for k in keys], num_single=len(keys), block_size=BLOCK,
            block_table=torch.tensor([tables[k] + [0] * (width - len(tables[k])) for k in keys]),
            slot_mapping=torch.tensor(slots), seq_keys=keys)

    for key, context in [(10, 5), (11, 17), (12, 1)]:
        admit(key, context)
    kept = SdpaPagedBackend(native=False)  # the mirror is the path without the C++ kernel
    groups = [[10, 11, 12]] * 3 + [[10, 12]] + [[10, 12, 13]] * 3
    rebuilds = []
    for step, keys in enumerate(groups):
        if 13 in keys and 13 not in tables:
            admit(13, 9)
        inputs = decode_inputs(keys)
        query = torch.randn(len(keys), HEADS, DIM, generator=generator)
        key = torch.randn(len(keys), KV_HEADS, DIM, generator=generator)
        value = torch.randn(len(keys), KV_HEADS, DIM, generator=generator)
        fresh = SdpaPagedBackend(native=False)
        expected = fresh.forward(query, key, value, kv_layer, fresh.prepare(inputs))
        torch.full((2 * len(keys) * 160 * KV_HEADS * DIM,), float("nan"))  # freed at once: reuse finds NaN
        metadata = kept.prepare(inputs)
        rebuilds.append(metadata.mirror_step.rebuild if metadata.mirror_step else None)
        assert torch.equal(kept.forward(query, key, value, kv_layer, metadata), expected), f"step {step}"
        assert all(torch.isfinite(layer).all() for layer in kept.mirror.layers.values())
        for k in keys:
            lengths[k] += 1
    # The first step learns the pool's size; then every change in the group rebuilds.
    assert rebuilds == [None, True, False, True, True, False, False]


def test_continued_chunks_give_sdpa_gqa_bits_in_bf16():
    """Chunks over cached context fold grouped query heads into the query axis; that must
    give exactly what SDPA's own GQA gives (bf16, where any reordering would show)."""
    generator = torch.Generator().manual_seed(2)
    context, new = 37, 6
    blocks = list(range(-(-(context + new) // BLOCK)))
    kv_layer = torch.randn(2, len(blocks) * BLOCK, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
    query = torch.randn(new, HEADS, DIM, generator=generator).to(torch.bfloat16)
    key = torch.randn(new, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
    value = torch.randn(new, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
    inputs = AttentionInputs(query_starts=[0], query_lens=[new], context_lens=[context + new], num_single=0,
                             block_size=BLOCK, block_table=torch.tensor([blocks]),
                             slot_mapping=torch.arange(context, context + new), seq_keys=[0])
    backend = select_backend("sdpa", torch.device("cpu"), DIM, torch.float32)
    output = backend.forward(query, key, value, kv_layer, backend.prepare(inputs))
    total = context + new
    causal = torch.arange(total)[None, :] <= torch.arange(context, total)[:, None]
    k, v = (cache[:total].transpose(0, 1)[None] for cache in kv_layer)  # written by forward
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], k, v, attn_mask=causal[None, None], enable_gqa=True)
    assert torch.equal(output, expected[0].transpose(0, 1))


def test_batched_fresh_prompts_give_each_prompts_own_bits_in_bf16():
    """Equal fresh prompts run as one SDPA call over a batch; each must get exactly what
    it gets alone (bf16, where any reordering would show)."""
    generator = torch.Generator().manual_seed(3)
    count, length = 5, 7
    query, key, value = (torch.randn(count * length, heads, DIM, generator=generator).to(torch.bfloat16)
                         for heads in (HEADS, KV_HEADS, KV_HEADS))
    backend = select_backend("sdpa", torch.device("cpu"), DIM, torch.float32)

    def attend(rows: slice, seqs: int) -> torch.Tensor:
        blocks = -(-length // BLOCK)
        kv_layer = torch.zeros(2, seqs * blocks * BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16)
        table = torch.arange(seqs * blocks).view(seqs, blocks)
        slots = torch.cat([table[i, :].repeat_interleave(BLOCK)[:length] * BLOCK
                           + torch.arange(length) % BLOCK for i in range(seqs)])
        inputs = AttentionInputs(query_starts=[i * length for i in range(seqs)], query_lens=[length] * seqs,
                                 context_lens=[length] * seqs, num_single=0, block_size=BLOCK,
                                 block_table=table, slot_mapping=slots)
        metadata = backend.prepare(inputs)
        assert len(metadata.groups) == 1  # one call for the whole batch
        return backend.forward(query[rows], key[rows], value[rows], kv_layer, metadata)

    together = attend(slice(None), count)
    for i in range(count):
        rows = slice(i * length, (i + 1) * length)
        assert torch.equal(together[rows], attend(rows, 1))
