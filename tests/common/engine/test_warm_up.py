"""Engine.warm_up runs the engine's step kinds once and leaves nothing behind."""
from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import Engine, warm_up_requests
from common.sampling_params import SamplingParams
from kernels.linear import row_buckets

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class Sink:
    """The BlockManager's KV event sink, recording what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def stored(self, block_hashes: list[int]) -> None:
        self.events += [("stored", name) for name in block_hashes]

    def removed(self, block_hashes: list[int]) -> None:
        self.events += [("removed", name) for name in block_hashes]


def engine_with(tiny_model_dir, test_device, sink, **overrides) -> Engine:
    settings = {"dtype": "float32", "kv_cache_gb": 0.05, "max_model_len": 1024, "device": test_device} | overrides
    config = EngineConfig(model_dir=tiny_model_dir, **settings)
    return Engine(config, kv_events=sink)


def test_warm_up_runs_the_model_yet_leaves_no_event_no_cached_block_and_no_stats(tiny_model_dir, test_device):
    sink = Sink()
    engine = engine_with(tiny_model_dir, test_device, sink)
    observed = []
    engine.step_observer = lambda plan, seconds: observed.append(plan)
    forwards: list[int] = []
    hook = engine.model.register_forward_hook(lambda *_: forwards.append(1))
    assert engine.block_manager.num_used == 0
    assert engine.warm_up() > 0
    hook.remove()
    assert len(forwards) >= 1 + 1 + 2 * 3  # the prefill, the hits' prefill, decode steps
    assert sink.events == [] and observed == []
    assert engine.stats.num_steps == 0 and engine.stats.num_computed_tokens == 0
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used == 0 and engine.block_manager.num_cached == 0
    engine.check_integrity()
    # The sink and the observer are back: a real request reports its blocks and steps.
    [result] = engine.generate([[5, 6, 7] * 12], GREEDY)
    assert result.num_cached_tokens == 0  # nothing of the warm-up is matched
    assert [kind for kind, _ in sink.events] == ["stored"] * (36 // engine.config.block_size)
    assert observed and engine.stats.num_steps == len(observed)


def test_a_warmed_engine_answers_exactly_as_a_fresh_one(tiny_model_dir, test_device, random_prompts):
    prompts = random_prompts([40, 3, 90], seed=21)
    fresh = engine_with(tiny_model_dir, test_device, None).generate(prompts, GREEDY)
    warmed = engine_with(tiny_model_dir, test_device, None)
    warmed.warm_up()
    assert [r.token_ids for r in warmed.generate(prompts, GREEDY)] == [r.token_ids for r in fresh]


def test_the_warm_up_prompts_hit_a_shared_prefix_and_fit_the_model(tiny_model_dir, test_device):
    [[base], hits] = warm_up_requests(vocab_size=512, block_size=16, max_model_len=1024)
    assert len(hits) == 2 and hits[0] != hits[1]
    shared = 3 * 16
    assert all(hit[:shared] == base[:shared] and hit[shared] != base[shared] for hit in hits)
    assert all(4 <= token < 512 for prompt in (base, *hits) for token in prompt)
    for max_model_len in (8, 40):  # tiny limits still leave room for the output
        for batch in warm_up_requests(512, 16, max_model_len):
            assert all(len(prompt) + 4 <= max_model_len for prompt in batch)


def test_warm_up_builds_the_linears_for_every_prefill_bucket_a_step_can_meet(tiny_model_dir, test_device,
                                                                             monkeypatch):
    engine = engine_with(tiny_model_dir, test_device, None, dtype="bfloat16", max_num_batched_tokens=512)
    linears = engine.model.layer_linears()
    shapes = {linear.build_key for linear in linears if linear.prepacked}
    assert engine.model.warm_up_linears(512) == len(shapes) * len(row_buckets(512))
    if shapes:  # every layer has the same four shapes: one linear of each is warmed
        assert len(shapes) == 4 < len(linears)
    asked: list[int] = []
    warm_up_linears = engine.model.warm_up_linears

    def recording(max_rows: int) -> int:
        asked.append(max_rows)
        return warm_up_linears(max_rows)

    monkeypatch.setattr(engine.model, "warm_up_linears", recording)
    engine.warm_up()
    assert asked == [512]  # a step's rows: at most its token budget


def test_warm_up_refuses_a_busy_engine(tiny_model_dir, test_device):
    engine = engine_with(tiny_model_dir, test_device, None)
    engine.add_request("busy", [5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()
