"""The runner's step inputs: decode inputs derived from the last step equal fresh ones."""
import torch

from common.engine.runner import ModelRunner
from common.sampling_params import SamplingParams


def assert_same_inputs(built, fresh):
    (inputs, input_ids, positions), (expected, expected_ids, expected_positions) = built, fresh
    for name in ("query_starts", "query_lens", "context_lens", "num_single", "block_size", "seq_keys"):
        assert getattr(inputs, name) == getattr(expected, name), name
    assert torch.equal(inputs.block_table, expected.block_table)
    assert torch.equal(inputs.slot_mapping, expected.slot_mapping)
    assert torch.equal(input_ids, expected_ids) and torch.equal(positions, expected_positions)


def test_derived_decode_inputs_equal_fresh_ones_through_joins_ends_and_preemption(make_engine, random_prompts):
    # 12 blocks of 16 tokens force preemptions; unequal max_tokens end sequences at
    # different steps; one request joins mid-flight; decode crosses block boundaries.
    engine = make_engine(num_kv_blocks=12, max_model_len=190)
    runner = engine.runner
    fresh_runner = ModelRunner(runner.model, runner.kv_cache, runner.backend, runner.device)
    build = runner._build_inputs
    derived_steps = 0

    def build_and_check(chunks):
        nonlocal derived_steps
        last = runner._last_decode
        built = build(chunks)
        fresh_runner._last_decode = None
        assert_same_inputs(built, fresh_runner._build_inputs(chunks))
        derived_steps += last is not None and built[0].block_table is last.block_table
        return built

    runner._build_inputs = build_and_check
    prompts = random_prompts([40, 55, 30, 61], seed=21)
    for index, max_tokens in enumerate([40, 25, 33]):
        engine.add_request(str(index), prompts[index], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      ignore_eos=True))
    for step in range(400):
        if step == 5:
            engine.add_request("3", prompts[3], SamplingParams(max_tokens=18, temperature=0, ignore_eos=True))
        engine.step()
        if step > 5 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert engine.stats.num_preemptions > 0
    assert derived_steps > 20
