"""Paged attention with torch's scaled_dot_product_attention (CPU, and CUDA without
flash-attn).

Per step (`prepare`) the batch is split into groups, each attended with one SDPA call
per layer:
  * the single-token queries (decode), as one padded batch over their cached context;
  * every chunk with no earlier context (a fresh prompt), causally over its own K/V,
    with no gather and no mask;
  * the remaining chunks (continued prefills, prefix-cache hits), as one padded batch
    with a causal mask offset by each chunk's context.
Padded batches gather whole KV blocks (one row per block, not per token) and mask the
tail past each sequence's length.

On the CPU, where Baton's C++ kernel (kernels/csrc/paged_attention.cpp) built, the
single-token queries go to it instead: it reads their context from the pool in place.
In bf16 on CPUs with AMX tiles, chunks over cached context and fresh chunks of up to
AMX_FRESH_MAX_TOKENS likewise go to kernels/csrc/amx_attention.cpp (`amx_chunks`), with
no gather and no mask: on fresh 1,024-token prompts it prefilled the small model ~7% and
the tiny one ~20% faster than SDPA's flash kernel.

Without it, the decode group keeps a mirror: its sequences' K/V, dense, per layer.
While the same sequences decode step after step, each step appends one token per
sequence to the mirror instead of gathering every sequence's whole context again; any
change in the group (a sequence joins, ends or is preempted) rebuilds it. The paged
pool stays the source of truth; the mirror is a per-engine cache of it, kept on CPU only
(where gathers were measured to cost) and to at most 1/MIRROR_POOL_SHARE of the pool.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.attention import AttentionBackend, AttentionInputs

# On CUDA, SDPA may pick cuDNN's fused attention, which builds an execution plan for every
# new shape; decode brings a new context length every step, and the small default model's
# decode steps took ~43 ms on an H200 instead of ~6. Flash and memory-efficient kernels
# need no per-shape plan.
CUDA_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MIRROR_POOL_SHARE = 8  # the mirror holds at most this fraction (1/8) of the pool's tokens
MIRROR_HEADROOM = 64  # positions a rebuilt mirror leaves for the steps after it
# Fresh chunks up to this many tokens go to the AMX kernel: on the small model it beat
# SDPA's flash kernel by 7 % at 1,024 tokens and 3 % at 2,080, and lost by 8 % at 4,000
# (its softmax runs on vector lanes, and its cost grows with the square of the length).
AMX_FRESH_MAX_TOKENS = 2048


@dataclass
class _Fresh:
    """`num_seqs` chunks of `query_len` tokens each with no earlier context, back to back
    from `first_row` (equal fresh prompts batch into one causal SDPA call)."""

    first_row: int
    query_len: int
    num_seqs: int = 1

    @property
    def num_rows(self) -> int:
        return self.query_len * self.num_seqs


@dataclass
class _Paged:
    """Sequences attending over paged context in one padded SDPA call."""

    blocks: torch.Tensor  # [seqs * blocks_per_seq] block ids, row-major
    num_seqs: int
    max_len: int  # longest context; keys past it are sliced off
    block_size: int
    mask: torch.Tensor | None  # [seqs, 1, q_len, max_len] True = attend; None = all valid or lone_chunk
    query_len: int
    first_row: int  # contiguous queries (decode): rows first_row..first_row + num_seqs * query_len
    row_index: torch.Tensor | None = None  # [seqs, q_len] flat rows of padded queries, else None
    valid_rows: torch.Tensor | None = None  # [seqs, q_len] which padded queries are real
    target_rows: torch.Tensor | None = None  # flat rows of the real queries, in valid_rows order
    folded: torch.Tensor | None = None  # the mask for folded queries, made by the first layer
    lone_chunk: bool = False  # one chunk, no padding: `mask` is None, the causal offset implied

    def folded_mask(self, dtype: torch.dtype, per_kv: int) -> torch.Tensor:
        """The chunk mask for queries folded per_kv times along the query axis, as 0 / -inf
        (SDPA would convert a boolean one in every layer; same bits), made once per step."""
        if self.folded is None:
            if self.lone_chunk:  # query j sees all earlier context and its chunk up to j
                q_len, device = self.query_len, self.blocks.device
                additive = torch.zeros(per_kv, q_len, self.max_len, dtype=dtype, device=device)
                additive[:, :, self.max_len - q_len:] = torch.full(
                    (q_len, q_len), float("-inf"), dtype=dtype, device=device).triu_(1)
                self.folded = additive.view(1, 1, per_kv * q_len, self.max_len)
            else:
                mask = self.mask
                assert mask is not None  # a chunk group has a mask unless it is a lone chunk
                additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                additive.masked_fill_(~mask, float("-inf"))
                self.folded = additive.repeat(1, 1, per_kv, 1)
        return self.folded


@dataclass
class _Native:
    """Sequences attended by a C++ kernel straight from the block pool, their rows of the
    output written in place: decode tokens by kernels/csrc/paged_attention.cpp, chunks
    over cached context by kernels/csrc/amx_attention.cpp (`amx`)."""

    block_table: torch.Tensor  # [seqs, width], contiguous
    query_starts: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    amx: bool = False


@dataclass
class _Mirror:
    """The decode group's K/V, dense: layer cache storage -> [2, seqs, capacity, heads, dim]."""

    seq_keys: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)  # positions held per row
    capacity: int = 0
    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    appended_at: torch.Tensor | None = None  # the last append's flat positions


@dataclass
class _MirrorStep:
    """What this step does to the mirror: append at `append_at` (flat row × capacity +
    position), or rebuild it from the pool."""

    rebuild: bool
    append_at: torch.Tensor | None


@dataclass
class SdpaMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Fresh | _Paged | _Native]
    covers_all_rows: bool  # one group whose output is the whole batch's, in order
    mirror_step: _MirrorStep | None = None  # for the decode group (groups[0]), if mirrored


class SdpaPagedBackend(AttentionBackend[SdpaMetadata]):
    name = "sdpa"

    def __init__(self, device: torch.device = torch.device("cpu"), fold_decode: bool | None = None,
                 native: bool | None = None, amx_chunks: bool = False) -> None:
        """fold_decode: attend decode queries with their grouped-query heads folded into
        rows (see _attend_decode_folded); None decides by device: on CUDA only (on the
        CPU, broadcasting was 1.0-1.7x faster at decode shapes of both default models).
        native: decode tokens through the C++ kernel; None: on the CPU where it builds.
        amx_chunks: chunks over cached context and fresh chunks of up to
        AMX_FRESH_MAX_TOKENS through the AMX kernel (bf16, CPUs with AMX; see
        amx_chunks_fit) instead of SDPA (and a gather, for chunks over cached context)."""
        self.on_cuda = torch.device(device).type == "cuda"
        self.fold_decode = self.on_cuda if fold_decode is None else fold_decode
        if native is None:
            from kernels.native import load_native_ops

            native = not self.on_cuda and load_native_ops()
        self.native = native
        self.amx_chunks = amx_chunks
        self._paged_attention = torch.ops.baton.paged_attention.default if native else None
        self._amx_attention = torch.ops.baton.amx_paged_attention.default if amx_chunks else None
        self.mirror = _Mirror()
        self.pool_tokens: int | None = None  # one layer's cache slots, learned from the first forward

    def prepare(self, inputs: AttentionInputs) -> SdpaMetadata:
        groups: list[_Fresh | _Paged | _Native] = []
        mirror_step = None
        if inputs.num_single and self.native:
            groups.append(_native_decode_group(inputs))
        elif inputs.num_single:
            groups.append(_single_token_group(inputs))
            mirror_step = self._plan_mirror(inputs)
        first = inputs.num_single
        fresh = [i for i in range(first, inputs.num_seqs) if inputs.context_lens[i] == inputs.query_lens[i]]
        if self.amx_chunks:  # the kernel takes fresh chunks too, up to the length where flash overtakes it
            fresh = [i for i in fresh if inputs.query_lens[i] > AMX_FRESH_MAX_TOKENS]
        groups += _fresh_groups(inputs, fresh)
        continuing = [i for i in range(first, inputs.num_seqs) if i not in set(fresh)]
        if continuing and self.amx_chunks:
            groups.append(_native_chunk_group(inputs, continuing))
        elif continuing:
            groups.append(_chunk_group(inputs, continuing))
        covers = len(groups) == 1 and (isinstance(groups[0], _Fresh)
                                       or isinstance(groups[0], _Paged) and groups[0].row_index is None)
        return SdpaMetadata(inputs.slot_mapping, groups, covers, mirror_step)

    def _plan_mirror(self, inputs: AttentionInputs) -> _MirrorStep | None:
        """Append to the mirror if the decode group is the one it holds, one token further
        on; rebuild it otherwise; None (no mirror) off CPU, without keys, before the pool's
        size is known, or when it would exceed its share of the pool."""
        mirror, count = self.mirror, inputs.num_single
        if inputs.seq_keys is None or self.pool_tokens is None or inputs.block_table.device.type != "cpu":
            mirror.layers.clear()
            return None
        keys, lens = inputs.seq_keys[:count], inputs.context_lens[:count]
        max_len = max(lens)
        steady = (keys == mirror.seq_keys and max_len <= mirror.capacity and mirror.layers
                  and all(new == held + 1 for new, held in zip(lens, mirror.context_lens)))
        mirror.seq_keys, mirror.context_lens = keys, lens
        if steady:
            if mirror.appended_at is None:  # the first append after a rebuild
                positions = torch.tensor(lens, device=inputs.block_table.device) - 1
                mirror.appended_at = torch.arange(count, device=positions.device) * mirror.capacity + positions
            else:  # every sequence is one token further on
                mirror.appended_at = mirror.appended_at + 1
            return _MirrorStep(False, mirror.appended_at)
        mirror.layers.clear()
        mirror.appended_at = None
        capacity = -(-(max_len + MIRROR_HEADROOM) // inputs.block_size) * inputs.block_size
        if count * capacity > self.pool_tokens // MIRROR_POOL_SHARE:
            mirror.seq_keys, mirror.capacity = [], 0
            return None
        mirror.capacity = capacity
        return _MirrorStep(True, None)

    def step_scope(self) -> contextlib.AbstractContextManager:
        """On CUDA, SDPA's kernels without cuDNN's (entered once a step: ~14 µs a time)."""
        return sdpa_kernel(CUDA_SDPA_KERNELS) if self.on_cuda else contextlib.nullcontext()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
                metadata: SdpaMetadata, kv_stored: bool = False) -> torch.Tensor:
        self.pool_tokens = kv_layer.shape[1]
        if not kv_stored:
            kv_layer[0].index_copy_(0, metadata.slot_mapping, key)
            kv_layer[1].index_copy_(0, metadata.slot_mapping, value)
        mirrored = None
        if metadata.mirror_step:  # planned for the decode group only, a _Paged one
            mirrored = self._mirrored_kv(cast(_Paged, metadata.groups[0]), metadata.mirror_step, key, value,
                                         kv_layer)
        if metadata.covers_all_rows:  # then the one group is a _Fresh or a _Paged (see prepare)
            return _attend(cast("_Fresh | _Paged", metadata.groups[0]), query, key, value, kv_layer, mirrored,
                           self.fold_decode)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for group in metadata.groups:
            if isinstance(group, _Native):
                kernel = self._amx_attention if group.amx else self._paged_attention
                assert kernel is not None  # prepare plans a _Native group only where its kernel loaded
                kernel(query, kv_layer[0], kv_layer[1], group.block_table, group.query_starts, group.query_lens,
                       group.context_lens, group.block_size, query.shape[-1] ** -0.5, output)
                continue
            own_mirror = mirrored if group is metadata.groups[0] else None
            attended = _attend(group, query, key, value, kv_layer, own_mirror, self.fold_decode)
            if isinstance(group, _Paged) and group.row_index is not None:
                assert group.target_rows is not None  # set with row_index
                output.index_copy_(0, group.target_rows, attended[group.valid_rows])
            else:
                first = group.first_row
                output[first:first + attended.shape[0]] = attended
        return output

    def _mirrored_kv(self, group: _Paged, step: _MirrorStep, key: torch.Tensor, value: torch.Tensor,
                     kv_layer: torch.Tensor) -> torch.Tensor:
        """This layer's mirror of the decode `group`, brought up to this step:
        [2, seqs, capacity, heads, dim]."""
        mirror = self.mirror
        layer_key = kv_layer.data_ptr()
        if step.rebuild:
            layer = torch.empty(2, group.num_seqs, mirror.capacity, *kv_layer.shape[2:],
                                dtype=kv_layer.dtype, device=kv_layer.device)
            for half, gathered in zip(layer, _gather(group, kv_layer)):
                held = min(gathered.shape[1], mirror.capacity)
                half[:, :held] = gathered[:, :held]
                # Masked keys still meet their values (weight 0 × value): whatever SDPA may
                # read must be finite, so the headroom starts at zero, not as reused memory.
                half[:, held:].zero_()
            mirror.layers[layer_key] = layer
            return layer
        layer = mirror.layers[layer_key]
        assert step.append_at is not None  # an append (not a rebuild) step has its positions
        rows = group.num_seqs
        flat = layer.view(2, rows * mirror.capacity, *layer.shape[3:])
        flat[0].index_copy_(0, step.append_at, key[:rows])
        flat[1].index_copy_(0, step.append_at, value[:rows])
        return layer


# ---- per layer -----------------------------------------------------------------------

def _gather(group: _Paged, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's context K and V as whole blocks, each one contiguous row (index_select's
    fast path): [seqs, blocks × block_size, kv_heads, dim] each, past max_len included."""
    heads, dim = kv_layer.shape[2:]
    row = group.block_size * heads * dim
    k, v = (cache.view(-1, row).index_select(0, group.blocks).view(group.num_seqs, -1, heads, dim)
            for cache in kv_layer)
    return k, v


def _attend(group: _Fresh | _Paged, query, key, value, kv_layer, mirrored=None,
            fold_decode: bool = False) -> torch.Tensor:
    if isinstance(group, _Fresh):
        rows = slice(group.first_row, group.first_row + group.num_rows)
        q, k, v = (x[rows].view(group.num_seqs, group.query_len, *x.shape[1:]).transpose(1, 2)
                   for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(group.num_rows, *query.shape[1:])
    if group.row_index is None:
        start = group.first_row
        q = query[start:start + group.num_seqs * group.query_len]
        q = q.view(group.num_seqs, group.query_len, *query.shape[1:])
    else:
        q = query[group.row_index]
    k, v = mirrored if mirrored is not None else _gather(group, kv_layer)
    k, v = k[:, :group.max_len].transpose(1, 2), v[:, :group.max_len].transpose(1, 2)
    if group.query_len > 1:  # chunks: a decode token's query length is 1
        out = _attend_folded(group, q, k, v)
    elif fold_decode:
        out = _attend_decode_folded(group, q, k, v)
    else:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=group.mask,
                                             enable_gqa=True).transpose(1, 2)  # [seqs, q_len, heads, dim]
    if group.row_index is None:
        return out.reshape(-1, *out.shape[2:])
    return out


def _attend_decode_folded(group: _Paged, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode queries with grouped-query heads: the G query heads of each KV head become G
    query rows of it, one SDPA call without GQA broadcasting. Same result; on CUDA, GQA
    broadcasting made a Llama-3-8B decode step at batch 128, context 2,083 take 478 ms on
    an H200, folded 47 ms. q [seqs, 1, heads, dim]; k, v [seqs, kv_heads, len, dim]."""
    seqs, _, heads, dim = q.shape
    kv_heads = k.shape[1]
    folded = q.view(seqs, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=group.mask)  # mask [seqs, 1, 1, len]
    return out.reshape(seqs, 1, heads, dim)


def _attend_folded(group: _Paged, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Chunks with grouped-query heads: the G query heads of each KV head become G × q_len
    query rows of it (mask repeated to match), one SDPA call without GQA broadcasting.
    Same bits, and faster on CPU. q [seqs, q_len, heads, dim]; k, v [seqs, kv_heads, len, dim]."""
    seqs, q_len, heads, dim = q.shape
    kv_heads = k.shape[1]
    per_kv = heads // kv_heads
    folded = q.view(seqs, q_len, kv_heads, per_kv, dim).permute(0, 2, 3, 1, 4).reshape(
        seqs, kv_heads, per_kv * q_len, dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=group.folded_mask(q.dtype, per_kv))
    out = out.view(seqs, kv_heads, per_kv, q_len, dim).permute(0, 3, 1, 2, 4)  # [seqs, q_len, kv, g, dim]
    return out.reshape(seqs, q_len, heads, dim)


# ---- per step ------------------------------------------------------------------------

def _blocks(inputs: AttentionInputs, seqs: list[int] | slice | torch.Tensor, max_len: int) -> torch.Tensor:
    per_seq = -(-max_len // inputs.block_size)
    return inputs.block_table[seqs, :per_seq].reshape(-1)


def _single_token_group(inputs: AttentionInputs) -> _Paged:
    count = inputs.num_single
    lens = inputs.context_lens[:count]
    max_len = max(lens)
    mask = None
    if min(lens) != max_len:
        device = inputs.block_table.device
        lens_tensor = torch.tensor(lens, device=device)
        positions = torch.arange(max_len, device=device)
        mask = (positions < lens_tensor[:, None]).view(count, 1, 1, max_len)
    return _Paged(_blocks(inputs, slice(0, count), max_len), count, max_len, inputs.block_size, mask,
                  query_len=1, first_row=0)


def _native_decode_group(inputs: AttentionInputs) -> _Native:
    """The single-token queries (rows 0..num_single-1) for the C++ kernel."""
    count, device = inputs.num_single, inputs.block_table.device
    lens = inputs.context_lens[:count]
    width = -(-max(lens) // inputs.block_size)
    return _Native(inputs.block_table[:count, :width].contiguous(), torch.arange(count, device=device),
                   torch.ones(count, dtype=torch.long, device=device), torch.tensor(lens, device=device),
                   inputs.block_size)


NativeDecode = _Native  # what native_decode_group returns, named for callers outside this module


def native_decode_group(backend: AttentionBackend, metadata: object) -> _Native | None:
    """The step's decode group where every row of the step is a single-token decode query
    attended by kernels/csrc/paged_attention.cpp (common/engine/model.py then runs each
    layer as one C++ op); None for any other step or backend."""
    if not isinstance(backend, SdpaPagedBackend) or not isinstance(metadata, SdpaMetadata):
        return None
    groups = metadata.groups
    if len(groups) != 1 or not isinstance(groups[0], _Native) or groups[0].amx:
        return None
    return groups[0]


def _native_chunk_group(inputs: AttentionInputs, seqs: list[int]) -> _Native:
    """Chunks over cached context (the given sequences) for the AMX kernel."""
    device = inputs.block_table.device
    width = -(-max(inputs.context_lens[i] for i in seqs) // inputs.block_size)
    index = torch.tensor(seqs, device=device)
    as_tensor = lambda values: torch.tensor([values[i] for i in seqs], device=device)  # noqa: E731
    return _Native(inputs.block_table[index, :width].contiguous(), as_tensor(inputs.query_starts),
                   as_tensor(inputs.query_lens), as_tensor(inputs.context_lens), inputs.block_size, amx=True)


def amx_chunks_fit(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether chunks can go through the AMX kernel: bf16 on a CPU whose AMX kernels run,
    head dims a multiple of 32 up to 256."""
    if head_dim % 32 or not 0 < head_dim <= 256:
        return False
    from kernels.native import amx_available

    return amx_available(device, dtype)


def _fresh_groups(inputs: AttentionInputs, fresh: list[int]) -> list[_Fresh]:
    """The fresh chunks as groups: a run of equal-length chunks, back to back in the
    batch, is one group (one SDPA call over a batch of them, same bits as one by one)."""
    groups: list[_Fresh] = []
    for i in fresh:
        start, length = inputs.query_starts[i], inputs.query_lens[i]
        last = groups[-1] if groups else None
        if last is not None and last.query_len == length and last.first_row + last.num_rows == start:
            last.num_seqs += 1
        else:
            groups.append(_Fresh(start, length))
    return groups


def _chunk_group(inputs: AttentionInputs, seqs: list[int]) -> _Paged:
    device = inputs.block_table.device
    q_lens = [inputs.query_lens[i] for i in seqs]
    ctx_lens = [inputs.context_lens[i] for i in seqs]
    starts = [inputs.query_starts[i] for i in seqs]
    max_q, max_len = max(q_lens), max(ctx_lens)
    blocks = _blocks(inputs, slice(seqs[0], seqs[-1] + 1) if seqs == list(range(seqs[0], seqs[-1] + 1))
                     else torch.tensor(seqs, device=device), max_len)
    if len(seqs) == 1:  # a lone chunk: no padding; query j sits at ctx - q_len + j
        return _Paged(blocks, 1, max_len, inputs.block_size, None, max_q, first_row=starts[0], lone_chunk=True)
    query_pos = torch.arange(max_q, device=device)[None, :]
    key_pos = torch.arange(max_len, device=device)
    q_lens_t = torch.tensor(q_lens, device=device)[:, None]
    ctx_lens_t = torch.tensor(ctx_lens, device=device)[:, None]
    # Query j of a chunk sits at absolute position (ctx - q_len + j).
    absolute = (ctx_lens_t - q_lens_t + query_pos)[:, :, None]
    mask = ((key_pos <= absolute) & (key_pos < ctx_lens_t[:, :, None])).unsqueeze(1)
    if min(q_lens) == max_q and starts == list(range(starts[0], starts[0] + len(seqs) * max_q, max_q)):
        # Equal chunks, back to back: their rows need no padding.
        return _Paged(blocks, len(seqs), max_len, inputs.block_size, mask, max_q, first_row=starts[0])
    starts_t = torch.tensor(starts, device=device)[:, None]
    row_index = starts_t + torch.minimum(query_pos, q_lens_t - 1)
    valid_rows = query_pos < q_lens_t
    return _Paged(blocks, len(seqs), max_len, inputs.block_size, mask, max_q, first_row=-1,
                  row_index=row_index, valid_rows=valid_rows, target_rows=row_index[valid_rows])
