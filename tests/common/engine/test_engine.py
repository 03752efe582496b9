"""Continuous batching, chunked prefill, prefix reuse and preemption keep outputs exact."""
from hypothesis import HealthCheck, given, settings, strategies as st

from common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def run_alone(engine, prompts, params=GREEDY):
    return [engine.generate([prompt], params)[0].token_ids for prompt in prompts]


def test_batched_mixed_lengths_equal_each_alone(make_engine, random_prompts):
    engine = make_engine()
    prompts = random_prompts([3, 17, 64, 150, 33, 1], seed=10)
    batched = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    engine.block_manager.reset_prefix_cache()
    assert batched == run_alone(engine, prompts)
    engine.check_integrity()


def test_requests_joining_mid_flight_equal_each_alone(make_engine, random_prompts):
    engine = make_engine()
    prompts = random_prompts([20, 90, 45], seed=11)
    outputs = {}
    engine.add_request("a", prompts[0], GREEDY)
    for step in range(200):
        if step == 3:
            engine.add_request("b", prompts[1], GREEDY)
        if step == 7:
            engine.add_request("c", prompts[2], GREEDY)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if step > 7 and not engine.has_unfinished():
            break
    engine.block_manager.reset_prefix_cache()
    assert [outputs[k] for k in "abc"] == run_alone(engine, prompts)


def test_chunked_prefill_equals_whole_prefill(make_engine, random_prompts):
    prompts = random_prompts([200, 37, 120], seed=12)
    whole = [r.token_ids for r in make_engine(max_num_batched_tokens=1024).generate(prompts, GREEDY)]
    for budget in (7, 16, 50):
        engine = make_engine(max_num_batched_tokens=budget, enable_prefix_caching=False)
        steps_before = engine.stats.num_steps
        assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == whole
        assert engine.stats.num_steps - steps_before > 357 // budget  # it really chunked


def test_prefix_hit_same_tokens_and_computes_only_missing(make_engine, random_prompts):
    engine = make_engine()
    prefix, suffix = random_prompts([160, 21], seed=13)
    prompt = prefix + suffix
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [cold] = engine.generate([prompt], params)
    assert cold.num_cached_tokens == 0
    computed_before = engine.stats.num_computed_tokens
    [warm] = engine.generate([prompt], params)
    computed = engine.stats.num_computed_tokens - computed_before
    assert warm.token_ids == cold.token_ids
    # 181 tokens = 11 full blocks of 16 + 5; all 11 are reused.
    assert warm.num_cached_tokens == 176
    # Missing prompt tokens, then one per decode step after the first sampled token.
    assert computed == (len(prompt) - 176) + (params.max_tokens - 1)


def test_shared_prefix_other_suffix_reuses_prefix_blocks(make_engine, random_prompts):
    engine = make_engine()
    prefix, suffix_a, suffix_b = random_prompts([128, 10, 30], seed=14)
    engine.generate([prefix + suffix_a], GREEDY)
    [hit] = engine.generate([prefix + suffix_b], GREEDY)
    assert hit.num_cached_tokens == 128
    engine.block_manager.reset_prefix_cache()
    assert hit.token_ids == run_alone(engine, [prefix + suffix_b])[0]


def test_a_burst_sharing_a_prompt_prefills_it_once(make_engine, random_prompts):
    """Four copies of a 200-token prompt fit one 1,024-token step; only the first
    computes it, the others wait a step and reuse its 12 full blocks."""
    [prompt] = random_prompts([200], seed=20)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = make_engine(max_num_batched_tokens=1024)
    results = engine.generate([prompt] * 4, params)
    assert [r.num_cached_tokens for r in results] == [0, 192, 192, 192]
    assert engine.stats.num_computed_tokens == 200 + 3 * 8 + 4 * (params.max_tokens - 1)
    alone = make_engine(max_num_batched_tokens=1024, wait_for_shared_prefill=False)
    assert [r.token_ids for r in alone.generate([prompt] * 4, params)] == [r.token_ids for r in results]
    assert alone.stats.num_computed_tokens == 4 * 200 + 4 * (params.max_tokens - 1)
    engine.check_integrity()


def test_a_preempted_prefill_does_not_hold_back_its_followers(make_engine, random_prompts):
    [prompt] = random_prompts([120], seed=22)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = make_engine().generate([prompt], params)[0].token_ids
    engine = make_engine(num_kv_blocks=12, max_model_len=160, max_num_batched_tokens=32)
    results = engine.generate([prompt] * 3, params)
    assert engine.stats.num_preemptions > 0
    assert [r.token_ids for r in results] == [expected] * 3
    engine.check_integrity()


def test_tenant_salt_isolates_prefix_cache(make_engine, random_prompts):
    engine = make_engine()
    [prompt] = random_prompts([64], seed=15)
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request("t1", prompt, params, tenant_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    hits = engine.stats.num_prefix_hit_tokens
    engine.add_request("t2", prompt, params, tenant_salt="tenant-b")
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_prefix_hit_tokens == hits
    engine.add_request("t3", prompt, params, tenant_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_prefix_hit_tokens == hits + 48  # (64 - 1) // 16 blocks


def test_preemption_and_resumption_keep_outputs(make_engine, random_prompts):
    prompts = random_prompts([40, 55, 30, 61], seed=16)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = make_engine()
    expected = [r.token_ids for r in roomy.generate(prompts, params)]
    # 12 blocks of 16 tokens cannot hold four sequences of ~90 tokens at once.
    tight = make_engine(num_kv_blocks=12, max_model_len=190)
    results = tight.generate(prompts, params)
    assert tight.stats.num_preemptions > 0
    assert [r.token_ids for r in results] == expected
    tight.check_integrity()
    assert tight.block_manager.num_used == 0


def test_seeded_sampling_survives_preemption(make_engine, random_prompts):
    prompts = random_prompts([40, 55, 30, 61], seed=17)
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
              for s in range(4)]
    expected = [r.token_ids for r in make_engine().generate(prompts, params)]
    tight = make_engine(num_kv_blocks=12, max_model_len=190)
    assert [r.token_ids for r in tight.generate(prompts, params)] == expected
    assert tight.stats.num_preemptions > 0


def test_abort_frees_blocks(make_engine, random_prompts):
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request("x", random_prompts([100])[0], GREEDY)
    engine.step()
    assert engine.block_manager.num_used > 0
    assert engine.abort("x") and not engine.abort("x")
    engine.check_integrity()
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished()


def test_lpm_policy_admits_longest_cached_prefix_first(make_engine, random_prompts):
    engine = make_engine(queue_policy="lpm", max_num_seqs=1)
    shared, other, tail_a, tail_b = random_prompts([96, 96, 8, 8], seed=18)
    engine.generate([shared + tail_a], SamplingParams(max_tokens=1, temperature=0))
    engine.add_request("cold", other + tail_a, SamplingParams(max_tokens=1, temperature=0))
    engine.add_request("warm", shared + tail_b, SamplingParams(max_tokens=1, temperature=0))
    first = engine.step()
    assert [o.request_id for o in first] == ["warm"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "abort"]),
                              st.integers(0, 3), st.integers(1, 60), st.integers(1, 12)),
                    min_size=5, max_size=30))
def test_random_workloads_keep_block_integrity(make_engine, random_prompts, ops):
    engine = make_engine(num_kv_blocks=14, max_model_len=100, max_num_batched_tokens=24)
    families = random_prompts([60] * 4, seed=19)
    live = []
    for index, (kind, family, length, max_tokens) in enumerate(ops):
        if kind == "add":
            request_id = f"r{index}"
            engine.add_request(request_id, families[family][:length] + [5 + index],
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            live.append(request_id)
        elif kind == "abort" and live:
            engine.abort(live.pop(family % len(live)))
        else:
            engine.step()
        engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.block_manager.num_used == 0
