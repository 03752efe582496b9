"""The scheduler's admission of waiting sequences behind a prefill of the same prompt,
on a real block manager without a model: plans are built, `complete` names blocks."""
import random

from common.engine.block_manager import BlockManager
from common.engine.queue_policy import make_queue_policy
from common.engine.scheduler import Scheduler, SchedulerConfig
from common.engine.sequence import Sequence
from common.sampling_params import SamplingParams

BLOCK = 16


def tokens(seed: int, count: int) -> list[int]:
    return random.Random(seed).choices(range(4, 30000), k=count)


def scheduler(budget: int = 512, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, 64, **config), BlockManager(256, BLOCK), make_queue_policy("fcfs"))


def add(sched: Scheduler, name: str, prompt: list[int]) -> Sequence:
    seq = Sequence(request_id=name, prompt_len=len(prompt), token_ids=list(prompt),
                   params=SamplingParams(max_tokens=4, ignore_eos=True), arrival_index=len(sched.waiting),
                   root_hash=7, block_size=BLOCK, eos_token_ids=frozenset(), max_model_len=4096)
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> dict[str, tuple[int, int]]:
    """Run one plan: request id -> (first token computed, tokens computed)."""
    plan = sched.schedule()
    sched.complete(plan)
    return {chunk.seq.request_id: (chunk.start, chunk.num_new) for chunk in plan.chunks}


def test_a_copy_of_a_prompt_in_prefill_waits_and_then_reuses_its_blocks():
    sched = scheduler(budget=1024)
    prompt = tokens(1, 200)
    add(sched, "first", prompt)
    add(sched, "copy", prompt)
    assert step(sched) == {"first": (0, 200)}
    assert step(sched)["copy"] == (192, 8)  # 12 full blocks reused, the rest computed


def test_only_a_block_being_prefilled_holds_a_request_back():
    sched = scheduler(budget=512)
    shared = tokens(1, 64)
    warm_up = add(sched, "warm-up", shared)
    step(sched)
    sched.finish(warm_up, "length")  # its 4 blocks stay cached
    long_prompt = shared + tokens(2, 300)
    add(sched, "long", long_prompt)
    add(sched, "same", long_prompt)  # its 5th block is being computed by "long"
    add(sched, "other", shared + tokens(3, 40))  # its 5th block is its own
    assert step(sched) == {"long": (64, 300), "other": (64, 40)}
    assert step(sched)["same"] == (352, 12)


def test_a_sequence_behind_a_waiting_copy_is_not_held_back():
    sched = scheduler(budget=1024)
    prompt = tokens(1, 100)
    add(sched, "first", prompt)
    add(sched, "copy", prompt)
    add(sched, "stranger", tokens(2, 100))
    assert set(step(sched)) == {"first", "stranger"}


def test_without_prefix_caching_or_with_the_option_off_copies_compute_at_once():
    prompt = tokens(1, 200)
    for sched in (scheduler(budget=1024, enable_prefix_caching=False),
                  scheduler(budget=1024, wait_for_shared_prefill=False)):
        add(sched, "first", prompt)
        add(sched, "copy", prompt)
        assert step(sched) == {"first": (0, 200), "copy": (0, 200)}


def test_a_copy_that_must_compute_its_last_block_anyway_does_not_wait_for_it():
    """A prompt of whole blocks always computes its last token, so its last block is
    never a hit: a copy whose only missing block is that one starts at once, even while
    the first computes the same block."""
    sched = scheduler(budget=48)
    prompt = tokens(1, 4 * BLOCK)
    add(sched, "first", prompt)
    assert step(sched) == {"first": (0, 48)}
    add(sched, "copy", prompt)
    assert step(sched) == {"first": (48, 16), "copy": (48, 16)}
