"""Executes a SchedulePlan: builds the step's tensors, runs the model, samples.

Everything per token is done with numpy/torch array ops; Python loops only over
sequences (and their block lists) once per step. Logits are computed only for the rows
that sample, and for the prompt rows of requests that ask for prompt logprobs
(docs/engine.md §2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from common.engine.kv_cache import KVCache
from common.engine.model import CausalLM
from common.engine.sampler import Sampler, token_logprobs
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
class PromptLogprobs:
    """Prompt logprob records one step computed for `seq`: those of its prompt tokens
    start, start + 1, ... (None for token 0, which nothing scores)."""

    seq: Sequence
    start: int
    records: list[dict | None]


@dataclass
class StepResult:
    """Tokens sampled this step, for the sequences whose chunk reached their end, and the
    prompt logprobs the step computed."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict | None]
    num_computed_tokens: int
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


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
        scoring = [(index, rows) for index, chunk in enumerate(chunks)
                   if chunk.seq.params.prompt_logprobs is not None and (rows := _prompt_rows(chunk)) is not None]
        logits_rows: torch.Tensor | slice
        if scoring:  # the sampling rows first, then each scored chunk's prompt rows
            logits_rows = self._sampling_and_prompt_rows(chunks, inputs.query_starts, sampling, scoring)
        elif len(sampling) == len(input_ids):  # one token per sequence, each sampled: every row
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
        prompt_logprobs = self._prompt_logprobs(chunks, scoring, logits[len(sampling):]) if scoring else []
        if not sampling:
            return StepResult([], [], [], len(input_ids), prompt_logprobs)
        token_ids, logprobs = self.sampler.sample(logits[:len(sampling)] if scoring else logits, seqs)
        return StepResult(seqs, token_ids, logprobs, len(input_ids), prompt_logprobs)

    def _sampling_and_prompt_rows(self, chunks: list[ScheduledChunk], query_starts: list[int], sampling: list[int],
                                  scoring: list[tuple[int, range]]) -> torch.Tensor:
        """Flat row indices: each sampling chunk's last row, then the prompt rows of each
        scored chunk in order (a chunk's position p is its row query_start + p - start)."""
        rows = [query_starts[i] + chunks[i].num_new - 1 for i in sampling]
        for index, positions in scoring:
            offset = query_starts[index] - chunks[index].start
            rows.extend(range(positions.start + offset, positions.stop + offset))
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], scoring: list[tuple[int, range]],
                         logits: torch.Tensor) -> list[PromptLogprobs]:
        """The records of the prompt tokens the scored rows predict (row p scores token
        p + 1; `logits` holds those rows in `scoring`'s order), and token 0's None for a
        sequence that has no record yet."""
        targets: list[int] = []
        for index, positions in scoring:
            targets.extend(chunks[index].seq.token_ids[positions.start + 1:positions.stop + 1])
        most = max(chunks[index].seq.params.prompt_logprobs or 0 for index, _ in scoring)
        chosen, top_ids, top_values = token_logprobs(
            logits, torch.tensor(targets, dtype=torch.long, device=logits.device), most)
        results, row = [], 0
        for index, positions in scoring:
            seq = chunks[index].seq
            end, top = row + len(positions), seq.params.prompt_logprobs or 0
            records: list[dict | None] = [
                {"token_id": token, "logprob": logprob, "top": list(zip(ids[:top], values[:top]))}
                for token, logprob, ids, values in zip(targets[row:end], chosen[row:end], top_ids[row:end],
                                                       top_values[row:end])]
            row = end
            start = positions.start + 1
            if not seq.prompt_logprobs:  # the first records: token 0's comes first
                records.insert(0, None)
                start = 0
            results.append(PromptLogprobs(seq, start, records))
        return results

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


def _prompt_rows(chunk: ScheduledChunk) -> range | None:
    """The positions of `chunk` whose logits score a prompt token its sequence has no
    record of yet (position p scores token p + 1, so they stop before the prompt's last
    position, whose logits sample the first output token); None when the chunk has no
    prompt record to give, an empty range when it gives only token 0's None (a prompt of
    one token)."""
    seq = chunk.seq
    first = max(chunk.start, len(seq.prompt_logprobs) - 1)
    last = min(chunk.start + chunk.num_new, seq.prompt_len - 1)
    if first < last:
        return range(first, last)
    return range(0) if not seq.prompt_logprobs else None


def _padded_block_table(chunks: list[ScheduledChunk]) -> np.ndarray:
    """[seqs, longest block list] block ids, padded with 0."""
    rows = [chunk.seq.block_ids for chunk in chunks]
    width = max(map(len, rows))
    padding = [0] * width
    return np.array([row if len(row) == width else row + padding[len(row):] for row in rows], dtype=np.int64)


def _slots(block_table: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray, size: int) -> np.ndarray:
    """The cache slot of each token: its sequence's block at its position, and the offset in it."""
    return block_table[seq_of_token, positions // size] * size + positions % size
