"""Waiting-queue policies; Preble's priority quotas bound the starvation LPM allows."""
import copy
import random

import pytest

from common.engine.config import QUEUE_POLICIES
from common.engine.queue_policy import PriorityQuotaPolicy, hit_group, make_queue_policy
from common.engine.sequence import Sequence
from common.sampling_params import SamplingParams

BLOCK = 16
NUM_TOKENS = 320  # 20 blocks, so each cached block is a hit ratio of 0.05
GROUP_BLOCKS = {0: 0, 1: 3, 2: 5, 3: 7, 7: 15, 9: 20}  # cached blocks that land in each group


class Waiting:
    """A waiting list whose sequences each have a fixed number of cached blocks."""

    def __init__(self):
        self.seqs: list[Sequence] = []
        self.cached: dict[str, int] = {}
        self._arrivals = 0

    def add(self, *cached_blocks: int) -> None:
        for blocks in cached_blocks:
            seq = Sequence(request_id=str(self._arrivals), prompt_len=NUM_TOKENS, token_ids=[5] * NUM_TOKENS,
                           params=SamplingParams(), arrival_index=self._arrivals, root_hash=0,
                           block_size=BLOCK, eos_token_ids=frozenset(), max_model_len=4096)
            self.seqs.append(seq)
            self.cached[seq.request_id] = blocks
            self._arrivals += 1

    def probe(self, seq: Sequence) -> int:
        return self.cached[seq.request_id]

    def order(self, policy) -> list[int]:
        """Arrival indices in the policy's order."""
        return [seq.arrival_index for seq in policy.order(self.seqs, self.probe)]

    def groups(self, policy) -> list[int]:
        """Groups of the sequences in the policy's order."""
        return [hit_group(self.probe(seq) * BLOCK, NUM_TOKENS) for seq in policy.order(self.seqs, self.probe)]

    def admit(self, policy, count: int) -> None:
        """Admit the first `count` of the policy's order, as the scheduler does."""
        for seq in policy.order(self.seqs, self.probe)[:count]:
            self.seqs.remove(seq)
            policy.admitted(seq)


@pytest.mark.parametrize("cached_tokens, group", [
    (0, 0), (1, 0), (5, 0), (10, 0), (11, 1), (15, 1), (90, 8), (91, 9), (100, 9), (120, 9),
])
def test_hit_group_is_ceil_of_tenths_minus_one(cached_tokens, group):
    assert hit_group(cached_tokens, 100) == group


def test_groups_come_from_cached_blocks_over_tokens():
    waiting = Waiting()
    waiting.add(0, 1, 2, 3, 20)  # hit ratios 0, 0.05, 0.1, 0.15, 1.0
    # One slot per unit: group 0 takes its best (2 blocks), group 1 the 0.15, group 9 the
    # full hit, and group 0 the rest one turn at a time.
    assert waiting.order(PriorityQuotaPolicy(quota_unit=1)) == [2, 3, 4, 1, 0]


def test_a_full_turn_gives_each_group_its_quota():
    waiting = Waiting()
    for index in range(180):
        waiting.add(GROUP_BLOCKS[0] if index % 6 == 0 else GROUP_BLOCKS[9])  # 30 low, 150 high
    assert waiting.groups(PriorityQuotaPolicy()) == [0] * 10 + [9] * 100 + [0] * 10 + [9] * 50 + [0] * 10


def test_longest_prefix_first_within_a_group_ties_by_arrival():
    waiting = Waiting()
    waiting.add(0, 2, 1, 2, 0)
    assert waiting.order(PriorityQuotaPolicy()) == [1, 3, 2, 0, 4]


def test_the_turn_persists_across_steps():
    policy = PriorityQuotaPolicy(quota_unit=1)  # group 0 gets 1 slot a turn, group 1 gets 2
    waiting = Waiting()
    waiting.add(0, 0, 3, 3)
    assert waiting.order(policy) == [0, 2, 3, 1]
    waiting.admit(policy, 1)
    assert waiting.order(policy) == [2, 3, 1]
    waiting.admit(policy, 1)
    waiting.add(3)
    # Group 1 has one slot left of its turn, then group 0's turn, then group 1's next.
    assert waiting.order(policy) == [3, 1, 4]
    assert waiting.order(PriorityQuotaPolicy(quota_unit=1)) == [1, 3, 4]


def test_empty_groups_are_skipped_without_using_a_turn():
    policy = PriorityQuotaPolicy(quota_unit=1)  # group 3 gets 4 slots a turn, group 9 gets 10
    waiting = Waiting()
    waiting.add(*[GROUP_BLOCKS[3]] * 8, *[GROUP_BLOCKS[9]] * 20)
    assert waiting.groups(policy) == [3] * 4 + [9] * 10 + [3] * 4 + [9] * 10
    waiting.admit(policy, 4)  # group 3's turn is used up; groups 4 to 8 are empty
    assert waiting.groups(policy) == [9] * 10 + [3] * 4 + [9] * 10


def test_admitting_any_prefix_of_the_order_continues_the_same_walk():
    rng = random.Random(0)
    policy = PriorityQuotaPolicy(quota_unit=1)
    waiting = Waiting()
    waiting.add(*[rng.choice(list(GROUP_BLOCKS.values())) for _ in range(30)])
    waiting.admit(policy, 7)  # start mid-turn
    order = waiting.order(policy)
    for count in range(len(order) + 1):
        later, rest = copy.deepcopy(policy), copy.deepcopy(waiting)
        rest.admit(later, count)
        assert rest.order(later) == order[count:]


def test_every_configured_policy_can_be_made():
    assert [make_queue_policy(name).name for name in QUEUE_POLICIES] == list(QUEUE_POLICIES)
    with pytest.raises(ValueError, match="queue_policy"):
        make_queue_policy("random")
    with pytest.raises(ValueError, match="quota_unit"):
        PriorityQuotaPolicy(quota_unit=0)


def steps_until_cold_request_runs(engine, random_prompts, limit: int) -> int | None:
    """Flood the engine with requests that hit a long cached prefix, 3 arriving per step
    against 2 admitted, and return how many steps a request with no hit waits; None if it
    is still waiting after `limit` steps."""
    shared, cold = random_prompts([64, 68], seed=30)
    once = SamplingParams(max_tokens=1, temperature=0)
    engine.generate([shared + [4]], once)  # cache the shared prefix
    flood = iter(range(10**6))

    def step() -> list[str]:
        for _ in range(3):
            engine.add_request(f"flood-{next(flood)}", shared + [7, 8, 9, 10], once)  # 64/68 hit
        return [output.request_id for output in engine.step()]

    for _ in range(5):  # the turn moves on to the high-hit group and a backlog builds
        step()
    engine.add_request("cold", cold, once)
    for waited in range(1, limit + 1):
        if "cold" in step():
            return waited
    return None


def test_priority_quotas_bound_the_wait_lpm_starves(make_engine, random_prompts):
    # The cold request arrives 10 admissions into group 9's turn of 100, 2 admitted a
    # step, so it waits out the other 90 and runs in the step after.
    limit = 60
    priority = make_engine(queue_policy="priority", max_num_seqs=2)
    waited = steps_until_cold_request_runs(priority, random_prompts, limit)
    assert waited is not None and 40 <= waited <= 50
    priority.check_integrity()
    lpm = make_engine(queue_policy="lpm", max_num_seqs=2)
    assert steps_until_cold_request_runs(lpm, random_prompts, limit) is None
