"""Executes a SchedulePlan: builds the step's tensors, runs the model, samples.

Everything per token is done with numpy/torch array ops; Python loops only over
sequences (and their block lists) once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from common.engine.kv_cache import KVCache
from common.engine.model import CausalLM
from common.engine.sampler import Sampler
from common.engine.scheduler import ScheduledChunk, SchedulePlan
from common.engine.sequence import Sequence
from kernels.attention import AttentionBackend, AttentionInputs


@dataclass
class _DecodeStep:
    """What the last all-decode step's inputs were built from, so that the next one can
    be derived from them when the same sequences advance one token within their blocks."""

    seq_keys: list[int]
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_table: torch.Tensor


@dataclass
class StepResult:
    """Tokens sampled this step, for the sequences whose chunk reached their end."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict | None]
    num_computed_tokens: int


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.sampler = Sampler()
        self._last_decode: _DecodeStep | None = None

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> StepResult:
        chunks = sorted(plan.chunks, key=lambda chunk: chunk.num_new != 1)
        inputs, input_ids, positions = self._build_inputs(chunks)
        sampling = [index for index, chunk in enumerate(chunks) if chunk.samples]
        seqs = [chunks[index].seq for index in sampling]
        logits_rows: torch.Tensor | slice
        if len(sampling) == len(input_ids):  # one token per sequence, each sampled: every row
            logits_rows = slice(None)
        elif not sampling:
            logits_rows = torch.zeros(0, dtype=torch.long, device=self.device)
        else:  # each sampling chunk's last row
            logits_rows = torch.tensor([inputs.query_starts[i] + inputs.query_lens[i] - 1 for i in sampling],
                                       dtype=torch.long, device=self.device)
        metadata = self.backend.prepare(inputs)
        with self.backend.step_scope():
            logits = self.model(input_ids, positions, inputs.slot_mapping, logits_rows, self.kv_cache, self.backend,
                                metadata)
        if not sampling:
            return StepResult([], [], [], len(input_ids))
        token_ids, logprobs = self.sampler.sample(logits, seqs)
        return StepResult(seqs, token_ids, logprobs, len(input_ids))

    def _build_inputs(self, chunks: list[ScheduledChunk]) -> tuple[AttentionInputs, torch.Tensor, torch.Tensor]:
        if all(chunk.num_new == 1 for chunk in chunks):
            return self._build_decode_inputs(chunks)
        self._last_decode = None
        size, device = self.block_size, self.device
        # Per-sequence metadata as plain lists (few entries); arrays only per token.
        query_lens = [c.num_new for c in chunks]
        starts = [c.start for c in chunks]
        query_starts = list(accumulate(query_lens, initial=0))
        num_tokens = query_starts.pop()
        flat_ids = []
        for c in chunks:
            flat_ids.extend(c.seq.token_ids[c.start:c.start + c.num_new])
        block_table = _padded_block_table(chunks)
        seq_of_token = np.repeat(np.arange(len(chunks)), query_lens)
        positions = np.arange(num_tokens) + np.subtract(starts, query_starts)[seq_of_token]
        slot_mapping = _slots(block_table, seq_of_token, positions, size)
        inputs = AttentionInputs(
            query_starts=query_starts,
            query_lens=query_lens,
            context_lens=[start + length for start, length in zip(starts, query_lens)],
            num_single=query_lens.count(1),
            block_size=size,
            block_table=torch.from_numpy(block_table).to(device),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            seq_keys=[c.seq.arrival_index for c in chunks],
        )
        input_ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
        return inputs, input_ids, torch.from_numpy(positions).to(device)

    def _build_decode_inputs(self,
                             chunks: list[ScheduledChunk]) -> tuple[AttentionInputs, torch.Tensor, torch.Tensor]:
        """_build_inputs for a step where every sequence decodes one token. While the same
        sequences advance by one token and none enters a new block, the block table is
        the last step's and every slot is the next one: only the new token ids are read."""
        size, device, count = self.block_size, self.device, len(chunks)
        seq_keys = [chunk.seq.arrival_index for chunk in chunks]
        positions = np.fromiter((chunk.start for chunk in chunks), dtype=np.int64, count=count)
        last = self._last_decode
        if (last is not None and last.seq_keys == seq_keys and np.array_equal(positions, last.positions + 1)
                and (positions % size).all()):
            slot_mapping, block_table = last.slot_mapping + 1, last.block_table
        else:
            table = _padded_block_table(chunks)
            slot_mapping = _slots(table, np.arange(count), positions, size)
            block_table = torch.from_numpy(table).to(device)
        self._last_decode = _DecodeStep(seq_keys, positions, slot_mapping, block_table)
        inputs = AttentionInputs(
            query_starts=list(range(count)), query_lens=[1] * count,
            context_lens=(positions + 1).tolist(), num_single=count, block_size=size,
            block_table=block_table, slot_mapping=torch.from_numpy(slot_mapping).to(device),
            seq_keys=seq_keys)
        input_ids = torch.tensor([chunk.seq.token_ids[chunk.start] for chunk in chunks],
                                 dtype=torch.long, device=device)
        return inputs, input_ids, torch.from_numpy(positions).to(device)


def _padded_block_table(chunks: list[ScheduledChunk]) -> np.ndarray:
    """[seqs, longest block list] block ids, padded with 0."""
    rows = [chunk.seq.block_ids for chunk in chunks]
    width = max(map(len, rows))
    padding = [0] * width
    return np.array([row if len(row) == width else row + padding[len(row):] for row in rows], dtype=np.int64)


def _slots(block_table: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    """The cache slot of each token: its sequence's block at its position, and the offset in it."""
    return block_table[seq_of_token, positions // size] * size + positions % size
