"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

All rows are processed as tensors; the only per-row Python work is drawing noise from
a request's own generator when it has a seed, so the same seed gives the same tokens
whatever else shares the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.engine.sequence import Sequence
from common.sampling_params import SamplingParams
from kernels.native import load_native_ops

ARGMAX_BLOCK = 128  # vocabulary columns per block in argmax_rows
SCORE_ROWS = 256  # rows per log_softmax in token_logprobs: bounds its [rows, vocab] temporary


class Sampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
        """logits: [rows, vocab] in the model's dtype, one row per sequence (greedy rows
        are argmaxed as they are; sampling and logprobs run in fp32). Returns token ids
        and, per row, a logprobs record or None."""
        params = [seq.params for seq in seqs]
        if all(p.greedy for p in params):
            tokens = argmax_rows(logits)
        else:
            logits = logits.float()  # once: .float() of fp32 logits below is the same tensor
            tokens = self._sample_random(logits, seqs)
        token_list = tokens.tolist()
        if all(p.logprobs is None for p in params):
            return token_list, [None] * len(seqs)
        return token_list, self._logprobs(logits.float(), tokens, params)

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [seq.params for seq in seqs]
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                   device=device, dtype=logits.dtype)
        scaled = logits / temperature[:, None]
        if any(0 < p.top_k < logits.shape[-1] for p in params):
            scaled = _apply_top_k(scaled, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            scaled = _apply_top_p(scaled, torch.tensor([p.top_p for p in params], device=device))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        # argmax(p / E) with E ~ Exp(1) is a draw from p (the exponential race).
        sampled = argmax_rows(probs / noise)
        return torch.where(greedy, argmax_rows(logits), sampled)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[dict | None]:
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        most = max(p.logprobs or 0 for p in params)
        top_values, top_ids = logprobs.topk(most, dim=-1) if most else (None, None)
        records: list[dict | None] = []
        for row, p in enumerate(params):
            if p.logprobs is None:
                records.append(None)
                continue
            top = []
            if p.logprobs:
                assert top_ids is not None and top_values is not None  # most >= p.logprobs > 0
                top = list(zip(top_ids[row, :p.logprobs].tolist(), top_values[row, :p.logprobs].tolist()))
            records.append({"token_id": int(tokens[row]), "logprob": chosen[row], "top": top})
        return records


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   top: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Each row's log-probability of its target token, and its `top` most likely tokens
    and their log-probabilities (empty lists for top 0). `logits`: [rows, vocab] in any
    float dtype, `targets`: [rows] token ids. The log_softmax runs in fp32 over SCORE_ROWS
    rows at a time, so a long prompt's scoring holds one slice of log-probabilities at
    once beside its logits."""
    chosen, top_ids, top_values = [], [], []
    for begin in range(0, logits.shape[0], SCORE_ROWS):
        logprobs = logits[begin:begin + SCORE_ROWS].float().log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, targets[begin:begin + SCORE_ROWS, None])[:, 0])
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    rows = logits.shape[0]
    if not chosen:
        return [], [], []
    if not top:
        return torch.cat(chosen).tolist(), [[]] * rows, [[]] * rows
    return torch.cat(chosen).tolist(), torch.cat(top_ids).tolist(), torch.cat(top_values).tolist()


def _apply_top_k(scaled: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=scaled.device)
    top_values = scaled.topk(int(ks.max()), dim=-1).values
    threshold = top_values.gather(1, (ks - 1)[:, None])
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep the smallest prefix whose mass reaches top_p; the top token always stays.
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(dim=-1) of a [rows, vocab] tensor, the first index on ties, as torch
    gives it. On CPU torch's argmax is a scalar loop (~1 ms for 32 rows of a 32k
    vocabulary): Baton's kernel (kernels/csrc/argmax.cpp) takes rows with unit column
    stride in any of the model's dtypes, argmax_by_blocks the rest."""
    if values.device.type != "cpu":
        return values.argmax(dim=-1)
    if values.stride(-1) == 1 and values.shape[-1] > 0 and load_native_ops():
        return torch.ops.baton.argmax_rows(values)
    return argmax_by_blocks(values)


def argmax_by_blocks(values: torch.Tensor) -> torch.Tensor:
    """argmax_rows in torch ops: torch's amax is vectorised where its argmax is not, so
    each row's best block of ARGMAX_BLOCK columns is found by amax, and only that block is
    argmaxed (~7x faster than argmax at 32k)."""
    rows, vocab = values.shape
    if vocab < 16 * ARGMAX_BLOCK:  # max's indices are argmax's (the first on ties), sooner
        return values.max(dim=-1).indices
    padding = -vocab % ARGMAX_BLOCK
    if padding:
        values = F.pad(values, (0, padding), value=float("-inf"))
    blocks = values.reshape(rows, -1, ARGMAX_BLOCK)  # a view when values is contiguous
    best_block = blocks.amax(dim=-1).max(dim=-1).indices
    within = blocks[torch.arange(rows, device=values.device), best_block].max(dim=-1).indices
    return best_block * ARGMAX_BLOCK + within
