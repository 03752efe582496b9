"""The engine's step observer and the step log: what each step ran, written and read back."""
import json

import pytest

from common.engine.step_log import StepLogError, StepLogWriter, busy_gaps, profile_points, read_step_log
from common.sampling_params import SamplingParams


def test_observer_sees_every_model_step_with_its_plan(make_engine, random_prompts):
    engine = make_engine(max_num_batched_tokens=64)
    seen = []
    engine.step_observer = lambda plan, seconds: seen.append(
        ([(chunk.seq.request_id, chunk.start, chunk.num_new) for chunk in plan.chunks], seconds))
    prompts = random_prompts([100, 30], seed=3)
    engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))

    assert engine.stats.num_steps == len(seen)
    assert all(seconds > 0 for _, seconds in seen)
    computed = sum(num_new for chunks, _ in seen for _, _, num_new in chunks)
    assert computed == engine.stats.num_computed_tokens == 130 + 2 * 4  # the last token needs no KV
    assert max(sum(num_new for _, _, num_new in chunks) for chunks, _ in seen) <= 64


def test_writer_logs_each_step_and_points_classify_them(make_engine, random_prompts, tmp_path):
    engine = make_engine(max_num_batched_tokens=64)
    path = tmp_path / "logs" / "worker-0.steps.jsonl"
    engine.step_observer = writer = StepLogWriter(path)
    prompts = random_prompts([100, 30], seed=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("long", prompts[0], params)
    for _ in range(3):  # 64 + 36 prompt tokens, then decodes alone
        engine.step()
    engine.add_request("short", prompts[1], params)
    while engine.has_unfinished():
        engine.step()
    writer.close()

    records = read_step_log(path)
    assert len(records) == engine.stats.num_steps
    assert records[0]["prefill"] == [[64, 0]] and records[0]["decode_seqs"] == 0
    assert records[1]["prefill"] == [[36, 64]]
    assert records[2] == {**records[2], "prefill": [], "decode_seqs": 1, "decode_ctx": 100}
    assert records[3]["prefill"] == [[30, 0]] and records[3]["decode_seqs"] == 1  # mixed
    assert all(later["t"] >= earlier["t"] for earlier, later in zip(records, records[1:]))

    points = profile_points(records)
    assert [(n, ctx) for n, ctx, _ in points["prefill"]] == [(64, 0), (36, 64)]
    decode_steps = [r for r in records if r["decode_seqs"] and not r["prefill"]]
    assert [(n, ctx) for n, ctx, _ in points["decode"]] == [
        (r["decode_seqs"], r["decode_ctx"] / r["decode_seqs"]) for r in decode_steps]
    assert (2, (102 + 30) / 2) in [(n, ctx) for n, ctx, _ in points["decode"]]


def test_busy_gaps_are_the_loops_time_before_each_decoding_step():
    def step(ended, seconds, decode_seqs, prefill=()):
        return {"t": ended, "s": seconds, "decode_seqs": decode_seqs, "decode_ctx": 10 * decode_seqs,
                "prefill": [list(chunk) for chunk in prefill]}

    records = [step(10.0, 0.004, 0, [(16, 0)]),   # a prompt: its sequence decodes next
               step(10.0015, 0.001, 1),           # 0.5 ms of loop before it
               step(10.0027, 0.001, 1),           # 0.2 ms
               step(12.0, 0.003, 0, [(8, 0)]),    # after an idle wait: a fresh prompt, no gap
               step(12.0013, 0.001, 2, [(4, 8)])]  # mixed, decoding: 0.3 ms
    assert busy_gaps(records) == pytest.approx([0.0005, 0.0002, 0.0003])
    assert busy_gaps(records[:1]) == []


def test_writer_appends_to_an_existing_log(tmp_path, make_engine, random_prompts):
    path = tmp_path / "steps.jsonl"
    for _ in range(2):
        engine = make_engine()
        engine.step_observer = writer = StepLogWriter(path)
        engine.generate(random_prompts([8]), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        writer.close()
    assert len(read_step_log(path)) == 4


@pytest.mark.parametrize("line, named", [
    ("not json", "Expecting value"),
    ("[1, 2]", "JSON object"),
    ('{"t": 1, "s": -0.1, "decode_seqs": 0, "decode_ctx": 0, "prefill": []}', "'s'"),
    ('{"t": 1, "s": 0.1, "decode_seqs": true, "decode_ctx": 0, "prefill": []}', "'decode_seqs'"),
    ('{"t": 1, "s": 0.1, "decode_seqs": 0, "prefill": []}', "'decode_ctx'"),
    ('{"t": 1, "s": 0.1, "decode_seqs": 0, "decode_ctx": 0, "prefill": [[1]]}', "'prefill'"),
    ('{"t": 1, "s": 0.1, "decode_seqs": 0, "decode_ctx": 0, "prefill": [[1, -2]]}', "'prefill'"),
])
def test_a_bad_line_is_named_by_file_and_number(tmp_path, line, named):
    path = tmp_path / "steps.jsonl"
    good = json.dumps({"t": 1.0, "s": 0.01, "decode_seqs": 2, "decode_ctx": 40, "prefill": []})
    path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
    with pytest.raises(StepLogError, match=f"steps.jsonl:3: .*{named}"):
        read_step_log(path)
