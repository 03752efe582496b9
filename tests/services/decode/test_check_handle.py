"""A handle from the wire must describe the prompt it came with (services/decode/imports.py):
the lease on the whole prompt names every block, a part a run of its full blocks."""
from __future__ import annotations

import pytest

from common.protocol import KvHandle
from common.sampling_params import InvalidRequestError
from services.decode.imports import check_handle

PROMPT = list(range(100))  # 6 full blocks of 16 and a partial one


def handle(block_ids: list[int], block_hashes: list[int], *, part: bool = False, first_block: int = 0,
           num_tokens: int = 100) -> KvHandle:
    return KvHandle("prefill-0", "tcp://127.0.0.1:7140", "ab" * 16, "i-1", block_ids, block_hashes, num_tokens,
                    -1 if part else 7, part=part, first_block=first_block)


def test_a_whole_lease_and_parts_that_fit_the_prompt_pass():
    check_handle(handle(list(range(7)), list(range(6))), PROMPT, 16)
    check_handle(handle([10, 11], [1, 2], part=True), PROMPT, 16)
    check_handle(handle([12, 13, 14, 15], [3, 4, 5, 6], part=True, first_block=2), PROMPT, 16)  # up to block 5


@pytest.mark.parametrize(("bad", "field"), [
    (handle([1], [1], part=True, num_tokens=99), "kv_handle.num_tokens"),
    (handle([], [], part=True), "kv_handle.block_ids"),  # an empty part
    (handle([1, 2], [1, 2], part=True, first_block=5), "kv_handle.block_ids"),  # past the last full block
    (handle([1], [1], part=True, first_block=6), "kv_handle.block_ids"),  # the partial block is never a part's
    (handle([1], [1], part=True, first_block=-1), "kv_handle.block_ids"),
    (handle([1, 1], [1, 2], part=True), "kv_handle.block_ids"),  # a block twice
    (handle([1, 2], [1], part=True), "kv_handle.block_hashes"),
    (handle(list(range(7)), list(range(6)), first_block=1), "kv_handle.first_block"),  # a whole lease from 0
    (handle(list(range(6)), list(range(6))), "kv_handle.block_ids"),  # the whole lease lacks a block
])
def test_a_handle_that_does_not_fit_is_refused_naming_the_field(bad: KvHandle, field: str):
    with pytest.raises(InvalidRequestError, match=field):
        check_handle(bad, PROMPT, 16)
