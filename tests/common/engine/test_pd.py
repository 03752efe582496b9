"""Prefill/decode inside the engine: a prefill engine holds a finished prompt's blocks
under a lease, a decode engine imports the request, the KV is copied block by block as a
transport would, and the decode engine finishes the request with the same greedy tokens
as one engine alone (fp32)."""
from __future__ import annotations

import pytest

from common.engine.engine import Engine
from common.engine.kv_connector import KvLoad, KvLoadError
from common.engine.leases import KvLease, LeaseError
from common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(make_engine):
    return make_engine(), make_engine(), make_engine()  # prefill, decode, reference


def prefill(engine: Engine, request_id: str, prompt: list[int]) -> tuple[int, KvLease]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       hold_kv=True)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                assert output.kv_lease is not None
                return output.new_token_ids[0], output.kv_lease


def copy_blocks(src: Engine, lease: KvLease, dst: Engine, plan: KvLoad) -> None:
    """What a transport does: block lease.block_ids[i] of src into plan's block of dst."""
    size = src.config.block_size
    for index, dst_block in enumerate(plan.dst_block_ids, start=plan.first_block):
        src_block = lease.block_ids[index]
        dst.kv_cache.data[:, :, dst_block * size:(dst_block + 1) * size] = \
            src.kv_cache.data[:, :, src_block * size:(src_block + 1) * size]


def decode(engine: Engine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.new_token_ids
                if output.finished:
                    return tokens
    return tokens


def transfer_and_decode(p: Engine, d: Engine, request_id: str, prompt: list[int]) -> tuple[list[int], KvLoad]:
    first, lease = prefill(p, request_id, prompt)
    plan = d.begin_load(request_id, prompt, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert plan is not None and plan.through_prompt_end
    copy_blocks(p, lease, d, plan)
    [output] = d.complete_load(request_id, len(plan.dst_block_ids))
    assert output.new_token_ids == [first] and not output.finished
    p.release_lease(lease.lease_id, request_id)
    return [first, *decode(d, request_id)], plan


def test_a_pulled_request_decodes_exactly_as_one_engine_would(engines, random_prompts):
    p, d, ref = engines
    for index, prompt in enumerate(random_prompts([37, 37, 37, 48], seed=1)):  # partial and full last block
        expected = ref.generate([prompt], GREEDY)[0].token_ids
        got, plan = transfer_and_decode(p, d, f"r{index}", prompt)
        assert got == expected
        assert plan.first_block == 0 and len(plan.dst_block_ids) == -(-len(prompt) // 16)
    p.check_integrity()
    d.check_integrity()
    assert p.leases.num_blocks == 0


def test_blocks_the_decode_engine_holds_are_not_pulled(engines, random_prompts):
    p, d, ref = engines
    shared = random_prompts([48], seed=2)[0]
    transfer_and_decode(p, d, "first", shared + [7, 8, 9])
    prompt = shared + [10, 11, 12, 13]
    got, plan = transfer_and_decode(p, d, "second", prompt)
    assert plan.first_block == 3 and len(plan.dst_block_ids) == 1
    assert got == ref.generate([prompt], GREEDY)[0].token_ids
    d.check_integrity()


def test_an_aborted_import_frees_its_blocks_for_the_next_request_at_once(engines, make_engine, random_prompts):
    p, _, ref = engines
    d = make_engine(num_kv_blocks=4, max_model_len=64)  # the survivor must take the victim's blocks
    victim, survivor = random_prompts([40, 40], seed=3)
    first, lease = prefill(p, "victim", victim)
    plan = d.begin_load("victim", victim, GREEDY, first_token_id=first, block_hashes=lease.block_hashes)
    assert plan is not None
    d.cancel_load("victim")  # the transport cancelled the pull first; nothing landed
    p.release_lease(lease.lease_id, "victim")
    d.check_integrity()
    got, again = transfer_and_decode(p, d, "survivor", survivor)
    assert set(again.dst_block_ids) & set(plan.dst_block_ids)  # the same blocks, reused
    assert got == ref.generate([survivor], GREEDY)[0].token_ids


def test_mismatched_block_names_are_refused_and_nothing_is_taken(engines, random_prompts):
    p, d, _ = engines
    prompt = random_prompts([40], seed=4)[0]
    first, lease = prefill(p, "salted", prompt)
    available = d.block_manager.num_available
    with pytest.raises(KvLoadError, match="tenant"):
        d.begin_load("salted", prompt, GREEDY, "another", first_token_id=first, block_hashes=lease.block_hashes)
    assert d.block_manager.num_available == available and not d.has_unfinished()
    with pytest.raises(LeaseError):
        p.release_lease(lease.lease_id, "someone-else")
    p.release_lease(lease.lease_id, "salted")


def test_a_released_lease_frees_its_blocks_and_they_stay_cached(engines, random_prompts):
    p, _, _ = engines
    prompt = random_prompts([40], seed=5)[0]
    _, lease = prefill(p, "let-go", prompt)
    used = p.block_manager.num_used
    assert p.leases.num_blocks == 3
    p.check_integrity()
    p.release_lease(lease.lease_id, "let-go")
    assert p.leases.num_blocks == 0 and p.block_manager.num_used == used - 3
    assert p.block_manager.match_prefix(lease.block_hashes, prompt, 2)  # the full blocks stay in the prefix cache
    p.check_integrity()


def test_an_import_that_does_not_fit_takes_nothing(engines, make_engine, random_prompts):
    p, _, _ = engines
    d = make_engine(num_kv_blocks=4, max_model_len=64)
    held, refused = random_prompts([40, 40], seed=6)
    first, lease = prefill(p, "held", held)
    assert d.begin_load("held", held, GREEDY, first_token_id=first) is not None  # 3 of the 4 blocks
    second_first, second_lease = prefill(p, "refused", refused)
    assert d.begin_load("refused", refused, GREEDY, first_token_id=second_first) is None
    assert d.block_manager.num_available == 1
    d.check_integrity()
    for request_id, handle in (("held", lease), ("refused", second_lease)):
        p.release_lease(handle.lease_id, request_id)


def test_a_prompt_moved_in_parts_while_it_is_prefilled_decodes_as_one_engine_would(make_engine, random_prompts):
    """A prefill engine that computes the prompt in chunks of 32 tokens leases each
    chunk's new full blocks as a part (a second reference, the request running on); the
    decode engine allocates the whole prompt before the first token exists, copies each
    part as it comes and the rest from the whole lease, and decodes from the first token
    given at the load's end: the reference engine's tokens, and every block freed once
    both leases are released."""
    p, d, ref = make_engine(max_num_batched_tokens=32), make_engine(), make_engine()
    prompt = random_prompts([150], seed=7)[0]  # 9 full blocks and a partial one
    p.add_request("parts", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold_kv=True)
    plan = d.begin_load("parts", prompt, GREEDY, through_prompt_end=True)
    assert plan is not None and plan.through_prompt_end and len(plan.dst_block_ids) == 10
    assert p.lease_part("parts", 0, 1) is None  # nothing computed yet
    parts, first, whole = [], None, None
    while whole is None:
        for output in p.step():
            if output.finished:
                first, whole = output.new_token_ids[0], output.kv_lease
        part = p.lease_part("parts", sum(len(lease.block_ids) for lease in parts), 2)
        if part is not None:
            assert part.part and part.first_token_id == -1 and part.num_tokens == 150
            assert part.block_hashes == d.block_names("parts")[part.first_block:part.first_block + len(part.block_ids)]
            parts.append(part)
            p.check_integrity()  # the part's reference is counted
    assert [(lease.first_block, len(lease.block_ids)) for lease in parts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert whole is not None and first is not None and not whole.part
    for lease in [*parts, whole]:  # each part, then the whole lease over every block (the copy is the same)
        for index, src in enumerate(lease.block_ids, start=lease.first_block):
            size = p.config.block_size
            dst = plan.dst_block_ids[index]
            d.kv_cache.data[:, :, dst * size:(dst + 1) * size] = p.kv_cache.data[:, :, src * size:(src + 1) * size]
    with pytest.raises(ValueError, match="first token"):
        d.complete_load("parts", 10)
    [output] = d.complete_load("parts", 10, first_token_id=first)
    assert [first, *decode(d, "parts")] == ref.generate([prompt], GREEDY)[0].token_ids
    assert output.new_token_ids == [first]
    for lease in [*parts, whole]:
        p.release_lease(lease.lease_id, "parts")
    p.check_integrity()
    d.check_integrity()
    assert p.block_manager.num_used == 0 and p.leases.num_blocks == 0
