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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionInputs


@dataclass
class _Fresh:
    """One chunk with no earlier context, at rows [first_row, first_row + num_rows)."""

    first_row: int
    num_rows: int


@dataclass
class _Paged:
    """Sequences attending over paged context in one padded SDPA call."""

    blocks: torch.Tensor  # [seqs * blocks_per_seq] block ids, row-major
    num_seqs: int
    max_len: int  # longest context; keys past it are sliced off
    block_size: int
    mask: torch.Tensor | None  # [seqs, 1, q_len, max_len] True = attend; None = all valid
    query_len: int
    first_row: int  # contiguous queries (decode): rows first_row..first_row + num_seqs * query_len
    row_index: torch.Tensor | None = None  # [seqs, q_len] flat rows of padded queries, else None
    valid_rows: torch.Tensor | None = None  # [seqs, q_len] which padded queries are real
    target_rows: torch.Tensor | None = None  # flat rows of the real queries, in valid_rows order


@dataclass
class SdpaMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Fresh | _Paged]
    covers_all_rows: bool  # one group whose output is the whole batch's, in order


class SdpaPagedBackend(AttentionBackend):
    name = "sdpa"

    def prepare(self, inputs: AttentionInputs) -> SdpaMetadata:
        groups: list[_Fresh | _Paged] = []
        if inputs.num_single:
            groups.append(_single_token_group(inputs))
        first = inputs.num_single
        fresh = [i for i in range(first, inputs.num_seqs) if inputs.context_lens[i] == inputs.query_lens[i]]
        groups += [_Fresh(inputs.query_starts[i], inputs.query_lens[i]) for i in fresh]
        continuing = [i for i in range(first, inputs.num_seqs) if i not in set(fresh)]
        if continuing:
            groups.append(_chunk_group(inputs, continuing))
        covers = len(groups) == 1 and (isinstance(groups[0], _Fresh) or groups[0].row_index is None)
        return SdpaMetadata(inputs.slot_mapping, groups, covers)

    def forward(self, query, key, value, kv_layer, metadata: SdpaMetadata):
        kv_layer[0].index_copy_(0, metadata.slot_mapping, key)
        kv_layer[1].index_copy_(0, metadata.slot_mapping, value)
        if metadata.covers_all_rows:
            return _attend(metadata.groups[0], query, key, value, kv_layer)
        output = torch.empty_like(query)
        for group in metadata.groups:
            attended = _attend(group, query, key, value, kv_layer)
            if isinstance(group, _Paged) and group.row_index is not None:
                output.index_copy_(0, group.target_rows, attended[group.valid_rows])
            else:
                first = group.first_row
                output[first:first + attended.shape[0]] = attended
        return output


# ---- per layer -----------------------------------------------------------------------

def _attend(group: _Fresh | _Paged, query, key, value, kv_layer) -> torch.Tensor:
    if isinstance(group, _Fresh):
        rows = slice(group.first_row, group.first_row + group.num_rows)
        q, k, v = (x[rows].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    if group.row_index is None:
        start = group.first_row
        q = query[start:start + group.num_seqs * group.query_len]
        q = q.view(group.num_seqs, group.query_len, *query.shape[1:])
    else:
        q = query[group.row_index]
    # Whole blocks, each one contiguous row (index_select's fast path): [seqs, len, kv_heads, dim].
    heads, dim = kv_layer.shape[2:]
    row = group.block_size * heads * dim
    k, v = (cache.view(-1, row).index_select(0, group.blocks).view(group.num_seqs, -1, heads, dim)
            [:, :group.max_len] for cache in kv_layer)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=group.mask, enable_gqa=True)
    out = out.transpose(1, 2)  # [seqs, q_len, heads, dim]
    if group.row_index is None:
        return out.reshape(-1, *out.shape[2:])
    return out


# ---- per step ------------------------------------------------------------------------

def _blocks(inputs: AttentionInputs, seqs: list[int] | slice, max_len: int) -> torch.Tensor:
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


def _chunk_group(inputs: AttentionInputs, seqs: list[int]) -> _Paged:
    device = inputs.block_table.device
    q_lens = [inputs.query_lens[i] for i in seqs]
    ctx_lens = [inputs.context_lens[i] for i in seqs]
    max_q, max_len = max(q_lens), max(ctx_lens)
    q_lens_t = torch.tensor(q_lens, device=device)[:, None]
    ctx_lens_t = torch.tensor(ctx_lens, device=device)[:, None]
    starts_t = torch.tensor([inputs.query_starts[i] for i in seqs], device=device)[:, None]
    query_pos = torch.arange(max_q, device=device)[None, :]
    row_index = starts_t + torch.minimum(query_pos, q_lens_t - 1)
    valid_rows = query_pos < q_lens_t
    key_pos = torch.arange(max_len, device=device)
    # Query j of a chunk sits at absolute position (ctx - q_len + j).
    absolute = (ctx_lens_t - q_lens_t + query_pos)[:, :, None]
    mask = (key_pos <= absolute) & (key_pos < ctx_lens_t[:, :, None])
    blocks = _blocks(inputs, torch.tensor(seqs, device=device), max_len)
    return _Paged(blocks, len(seqs), max_len, inputs.block_size, mask.unsqueeze(1), max_q, first_row=-1,
                  row_index=row_index, valid_rows=valid_rows, target_rows=row_index[valid_rows])
