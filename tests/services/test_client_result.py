"""How the SDK turns a request's chunks into its streamed chunks and its Result."""
from __future__ import annotations

from common.protocol import Chunk
from services.client._shared import Accumulator


def _chunks(*token_ids: list[int], timings: dict[str, float] | None = None) -> list[Chunk]:
    last = len(token_ids) - 1
    return [Chunk(request_id="r", token_ids=ids, text="x" * len(ids), finished=i == last,
                  finish_reason="length" if i == last else None, timings=(timings or {}) if i == last else {})
            for i, ids in enumerate(token_ids)]


def test_the_final_chunk_and_the_result_expose_the_request_timings():
    timings = {"queue_s": 0.01, "prefill_s": 0.2, "decode_wait_s": 0.0, "transfer_s": 0.03}
    accumulator = Accumulator("r")
    streamed = [accumulator.add(chunk) for chunk in _chunks([7], [8, 9], [10], timings=timings)]
    result = accumulator.result()
    assert [chunk.timings for chunk in streamed] == [{}, {}, timings]
    assert result.timings == timings and result.token_ids == [7, 8, 9, 10] and result.text == "xxxx"
    assert 0 <= result.ttft_s <= result.second_token_s <= result.e2e_s  # the second token came in the second chunk
    result.timings["queue_s"] = 5.0  # the result's own copy
    assert streamed[-1].timings["queue_s"] == 0.01


def test_a_request_served_by_one_worker_has_no_timings_and_one_token_no_second_token_time():
    accumulator = Accumulator("r")
    for chunk in _chunks([7]):
        accumulator.add(chunk)
    result = accumulator.result()
    assert result.timings == {} and result.second_token_s == 0.0 and result.ttft_s >= 0
