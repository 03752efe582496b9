"""Paged attention with torch's scaled_dot_product_attention (CPU, and CUDA without
flash-attn).

Each layer gathers every sequence's context K/V from the paged cache into a padded
batch and calls SDPA once for the single-token queries (decode) and once for the
multi-token chunks (prefill), with a mask built once per step. A lone chunk with no
earlier context skips the gather and runs causal SDPA on its own K/V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, AttentionInputs, context_slots


@dataclass
class _Group:
    """Sequences attended in one SDPA call."""

    slots: torch.Tensor | None  # [seqs, max_ctx] cache slots; None for the fresh-causal path
    mask: torch.Tensor | None  # [seqs, 1, q_len, max_ctx] True = attend; None = all valid
    row_index: torch.Tensor | None  # [seqs, q_len] flat rows of the queries; None = contiguous
    valid_rows: torch.Tensor | None  # [seqs, q_len] which padded queries are real
    first_row: int
    num_rows: int
    num_seqs: int
    query_len: int


@dataclass
class SdpaMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Group]


class SdpaPagedBackend(AttentionBackend):
    name = "sdpa"

    def prepare(self, inputs: AttentionInputs) -> SdpaMetadata:
        groups = []
        if inputs.num_single:
            groups.append(self._single_token_group(inputs))
        if inputs.num_seqs > inputs.num_single:
            groups.append(self._chunk_group(inputs))
        return SdpaMetadata(inputs.slot_mapping, groups)

    def forward(self, query, key, value, kv_layer, metadata: SdpaMetadata):
        kv_layer[0].index_copy_(0, metadata.slot_mapping, key)
        kv_layer[1].index_copy_(0, metadata.slot_mapping, value)
        if len(metadata.groups) == 1 and metadata.groups[0].row_index is None:
            return self._attend(metadata.groups[0], query, key, value, kv_layer)
        output = torch.empty_like(query)
        for group in metadata.groups:
            rows = slice(group.first_row, group.first_row + group.num_rows)
            attended = self._attend(group, query, key, value, kv_layer)
            if group.row_index is None:
                output[rows] = attended
            else:
                output[rows] = attended[group.valid_rows]
        return output

    # ---- per layer -----------------------------------------------------------------

    @staticmethod
    def _attend(group: _Group, query, key, value, kv_layer) -> torch.Tensor:
        rows = slice(group.first_row, group.first_row + group.num_rows)
        if group.slots is None:  # one fresh chunk: causal over its own K/V
            q = query[rows].transpose(0, 1).unsqueeze(0)
            k = key[rows].transpose(0, 1).unsqueeze(0)
            v = value[rows].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out.squeeze(0).transpose(0, 1)
        if group.row_index is None:
            q = query[rows].view(group.num_seqs, group.query_len, *query.shape[1:])
        else:
            q = query[group.row_index]
        # K and V of every context position in one gather: [2, seqs, ctx, kv_heads, dim].
        gathered = kv_layer.index_select(1, group.slots.reshape(-1))
        k, v = gathered.view(2, *group.slots.shape, *kv_layer.shape[2:])
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=group.mask, enable_gqa=True)
        out = out.transpose(1, 2)  # [seqs, q_len, heads, dim]
        if group.row_index is None:
            return out.reshape(group.num_rows, *out.shape[2:])
        return out

    # ---- per step ------------------------------------------------------------------

    @staticmethod
    def _single_token_group(inputs: AttentionInputs) -> _Group:
        count = inputs.num_single
        lens = inputs.context_lens[:count]
        max_len = max(lens)
        device = inputs.block_table.device
        lens_tensor = torch.tensor(lens, device=device)
        slots = context_slots(inputs.block_table[:count], max_len, inputs.block_size)
        mask = None
        if min(lens) != max_len:
            positions = torch.arange(max_len, device=device)
            mask = (positions < lens_tensor[:, None]).view(count, 1, 1, max_len)
        return _Group(slots, mask, None, None, 0, count, count, 1)

    @staticmethod
    def _chunk_group(inputs: AttentionInputs) -> _Group:
        first = inputs.num_single
        starts = inputs.query_starts[first:]
        q_lens = inputs.query_lens[first:]
        ctx_lens = inputs.context_lens[first:]
        num_rows = sum(q_lens)
        first_row = starts[0]
        if len(q_lens) == 1 and ctx_lens[0] == q_lens[0]:
            return _Group(None, None, None, None, first_row, num_rows, 1, q_lens[0])
        device = inputs.block_table.device
        max_q, max_ctx = max(q_lens), max(ctx_lens)
        q_lens_t = torch.tensor(q_lens, device=device)[:, None]
        ctx_lens_t = torch.tensor(ctx_lens, device=device)[:, None]
        starts_t = torch.tensor(starts, device=device)[:, None]
        query_pos = torch.arange(max_q, device=device)[None, :]
        row_index = starts_t + torch.minimum(query_pos, q_lens_t - 1)
        valid_rows = query_pos < q_lens_t
        key_pos = torch.arange(max_ctx, device=device)
        # Query j of a chunk sits at absolute position (ctx - q_len + j).
        absolute = (ctx_lens_t - q_lens_t + query_pos)[:, :, None]
        mask = (key_pos <= absolute) & (key_pos < ctx_lens_t[:, :, None])
        slots = context_slots(inputs.block_table[first:], max_ctx, inputs.block_size)
        return _Group(slots, mask.unsqueeze(1), row_index, valid_rows, first_row, num_rows,
                      len(q_lens), max_q)
