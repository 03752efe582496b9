"""EngineStats.decode_tokens / decode_seconds: the measured decode rate counts the steps
that prefilled nothing and after which work remained, each from its start to the next
step's start (common/engine/engine.py `step`)."""
import time

from common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_only_decode_steps_followed_by_a_step_are_counted(make_engine, random_prompts):
    engine = make_engine()
    started = time.perf_counter()
    engine.generate(random_prompts([20, 33, 7, 50], seed=3), GREEDY)
    wall = time.perf_counter() - started
    # Step 1 prefills all four prompts (their first tokens); steps 2-7 decode four tokens
    # each with work left after them; step 8 ends every request, so nothing follows it.
    assert engine.stats.decode_tokens == 4 * 6
    assert 0 < engine.stats.decode_seconds < wall


def test_time_the_engine_sat_idle_after_an_abort_is_not_decode_time(make_engine, random_prompts):
    engine = make_engine()
    [prompt] = random_prompts([24], seed=4)
    engine.add_request("a", prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # a prefill, then two decode steps
        engine.step()
    assert engine.abort("a") and not engine.has_unfinished()
    time.sleep(0.3)
    engine.add_request("b", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.stats.decode_tokens == 1  # the first decode step, timed up to the second
    assert engine.stats.decode_seconds < 0.3
