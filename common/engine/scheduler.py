"""Iteration-level scheduling: continuous batching with chunked prefill.

The scheduler decides; it does not compute. `schedule()` returns a SchedulePlan (which
sequences advance by how many tokens this step, who was preempted), the model runner
executes it, and `complete()` records what was computed. Preemption is by recompute:
a preempted sequence drops its blocks (they stay in the prefix cache while unevicted)
and is prefilled again, prompt plus output so far, when it is readmitted.

A waiting sequence whose next uncached prompt block another sequence is prefilling
(running, or admitted earlier in the same step) is passed over until that prefill has
named the block: it then reuses the blocks instead of computing them a second time. A
burst of requests sharing a long prompt costs one prefill of it, not one per request
the token budget admits before the first finishes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.engine.block_manager import BlockManager
from common.engine.queue_policy import QueuePolicy
from common.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool = True
    wait_for_shared_prefill: bool = True  # the module docstring; needs prefix caching


@dataclass(slots=True)
class ScheduledChunk:
    """`seq` computes tokens [start, start + num_new) this step."""

    seq: Sequence
    start: int
    num_new: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so a new token is
        sampled from its logits."""
        return self.start + self.num_new == self.seq.num_tokens


@dataclass
class SchedulePlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hits of the sequences admitted this step

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, policy: QueuePolicy):
        self.config = config
        self.block_manager = block_manager
        self.policy = policy
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.receiving: list[Sequence] = []  # blocks allocated, KV arriving from elsewhere

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def complete(self, plan: SchedulePlan) -> None:
        """Record that the plan ran: advance progress and name newly full blocks."""
        size = self.block_size
        caching = self.config.enable_prefix_caching
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed = chunk.start + chunk.num_new
            first, last = chunk.start // size, seq.num_computed // size
            if caching and last > first:  # most decode steps fill no block
                self.block_manager.commit(seq.block_ids, seq.block_hashes, seq.token_ids, first, last, seq.root_hash)

    def finish(self, seq: Sequence, reason: str, hold: bool = False) -> list[int]:
        """End a sequence (stopped, aborted, failed) and release its blocks, or with
        `hold` keep their references and return them (the caller now owns them)."""
        {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
         SequenceStatus.RECEIVING: self.receiving}[seq.status].remove(seq)
        blocks, seq.block_ids = seq.block_ids, []
        if not hold:
            self.block_manager.release(blocks)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return blocks

    def receive(self, seq: Sequence, hits: list[int], num_fresh: int) -> list[int] | None:
        """Give `seq` the cached blocks `hits` and `num_fresh` new ones for KV that will
        arrive from elsewhere; None, taking nothing, when the blocks or the batch are full.
        Returns the new blocks."""
        if len(self.running) + len(self.receiving) >= self.config.max_num_seqs or \
                self.block_manager.blocks_to_take(hits, num_fresh) > self.block_manager.num_available:
            return None
        self.block_manager.take(hits)
        fresh = self.block_manager.allocate(num_fresh)
        seq.block_ids = hits + fresh
        seq.status = SequenceStatus.RECEIVING
        self.receiving.append(seq)
        return fresh

    def received(self, seq: Sequence) -> None:
        """`seq`'s prompt KV has arrived: name its full blocks and let it decode."""
        self.receiving.remove(seq)
        seq.num_computed = seq.prompt_len
        if self.config.enable_prefix_caching:
            self.block_manager.commit(seq.block_ids, seq.block_hashes, seq.token_ids,
                                      0, seq.prompt_len // self.block_size, seq.root_hash)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def fetched(self, seq: Sequence, num_blocks: int) -> None:
        """`seq`'s first `num_blocks` blocks hold its prompt's KV (local prefix hits and
        blocks fetched from the KV store): name them, free its other blocks, and let it
        prefill the rest of its prompt in the running batch."""
        self.receiving.remove(seq)
        size = self.block_size
        if self.config.enable_prefix_caching:
            self.block_manager.commit(seq.block_ids, seq.block_hashes, seq.token_ids, 0, num_blocks,
                                      seq.root_hash)
        self.block_manager.release(seq.block_ids[num_blocks:])
        del seq.block_ids[num_blocks:]
        seq.num_computed = num_blocks * size
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def live_block_tables(self) -> list[list[int]]:
        return [seq.block_ids for seq in self.running + self.waiting + self.receiving]

    # ---- internals -----------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, num_tokens_after: int) -> int:
        return -(-num_tokens_after // self.block_size) - len(seq.block_ids)

    def _schedule_running(self, plan: SchedulePlan, budget: int) -> int:
        """Advance running sequences in admission order, preempting from the back when
        blocks run out. Returns the budget left."""
        queue = deque(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            if budget == 0:
                kept.append(seq)
                continue
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            needed = self._blocks_needed(seq, seq.num_computed + num_new)
            if needed > 0:  # most decode steps stay inside the last block
                while needed > self.block_manager.num_available and queue:
                    victim = queue.pop()
                    self._preempt(victim)
                    plan.preempted.append(victim)
                if needed > self.block_manager.num_available:
                    self._preempt(seq)
                    plan.preempted.append(seq)
                    continue
                seq.block_ids.extend(self.block_manager.allocate(needed))
            plan.chunks.append(ScheduledChunk(seq, seq.num_computed, num_new))
            kept.append(seq)
            budget -= num_new
        self.running = kept
        return budget

    def _admit_waiting(self, plan: SchedulePlan, budget: int) -> None:
        ordered = self.policy.order(self.waiting, self._cached_blocks)
        in_prefill: set[int] | None = None  # made on the first sequence that needs it
        wait_for_shared = self.config.enable_prefix_caching and self.config.wait_for_shared_prefill
        for seq in ordered:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hits = self._prefix_hits(seq)
            if wait_for_shared and len(hits) < self._max_hit_blocks(seq):
                if in_prefill is None:
                    in_prefill = self._blocks_in_prefill()
                if seq.block_hashes[len(hits)] in in_prefill:
                    continue
            num_cached = len(hits) * self.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            fresh = -(-(num_cached + num_new) // self.block_size) - len(hits)
            if self.block_manager.blocks_to_take(hits, fresh) > self.block_manager.num_available:
                break
            self.block_manager.take(hits)
            seq.block_ids = hits + self.block_manager.allocate(fresh)
            seq.num_computed = num_cached
            plan.num_cached_tokens += num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.policy.admitted(seq)
            plan.chunks.append(ScheduledChunk(seq, num_cached, num_new))
            budget -= num_new
            if in_prefill is not None:
                in_prefill.update(self._prompt_blocks_to_compute(seq))

    def _blocks_in_prefill(self) -> set[int]:
        """Names of the prompt blocks that running sequences have still to compute."""
        blocks: set[int] = set()
        for seq in self.running:
            blocks.update(self._prompt_blocks_to_compute(seq))
        return blocks

    def _prompt_blocks_to_compute(self, seq: Sequence) -> list[int]:
        size = self.block_size
        return seq.block_hashes[seq.num_computed // size:seq.prompt_len // size]

    def _max_hit_blocks(self, seq: Sequence) -> int:
        """At least one token must be computed to get logits, and computed tokens must
        never land in a shared block, so the last block boundary before the final token
        bounds the hit; a request that wants prompt logprobs also computes every position
        whose logits it still needs (as vLLM, which skips the prefix cache for them)."""
        if not self.config.enable_prefix_caching:
            return 0
        return max_hit_tokens(seq) // self.block_size

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        return self.block_manager.match_prefix(seq.block_hashes, seq.token_ids, self._max_hit_blocks(seq))

    def _cached_blocks(self, seq: Sequence) -> int:
        return self.block_manager.num_matched_cached(seq.block_hashes, self._max_hit_blocks(seq))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.release(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(0, seq)


def max_hit_tokens(seq: Sequence) -> int:
    """How many leading tokens of `seq` a cache may supply: all but the last (which must
    be computed to sample), and none from the first position whose logits score a prompt
    token the request has not had yet (docs/engine.md §2)."""
    limit = seq.num_tokens - 1
    row = seq.next_prompt_logprob_row
    return limit if row is None else min(limit, row)
