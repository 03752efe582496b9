"""scripts/index_memory.py: the index it measures is the router's, built as the router
builds it, and what it reports is that index's size."""
from __future__ import annotations

import json

from services.router.index import PrefixIndex
from tests.scripts import load_script


def write_trace(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_the_measured_index_holds_each_prompt_on_its_worker_and_its_bytes_are_counted(tmp_path):
    memory = load_script("index_memory")
    trace = write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 1030, "output_length": 1, "hash_ids": [0, 1, 3]},
        {"timestamp": 2, "input_length": 600, "output_length": 1, "hash_ids": [4, 5]},
        {"timestamp": 3, "input_length": 512, "output_length": 1, "hash_ids": [6]},
    ])
    prompts = [request.token_ids for request in memory.make_workload("mooncake", 10, trace=str(trace))]
    index = PrefixIndex(memory.BLOCK_SIZE)
    used = memory.build(index, prompts, workers=2, blocks=100)
    assert used == 3 and len(index) >= 100  # the third prompt passes 100 blocks
    index.check()
    for number, prompt in enumerate(prompts[:used], start=1):  # each prompt's every full block, on its worker
        path = index.walk(memory.ROOT, index.block_keys(prompt))
        assert index.match(path)[f"worker-{number % 2}"] == len(prompt) // memory.BLOCK_SIZE
    # The first two prompts share 2 of 3 trace blocks (64 of 16 tokens): 64 blocks are held twice.
    assert sum(index.num_blocks(worker) for worker in ("worker-0", "worker-1")) == len(index) + 64

    # Two chains under the root: the first two prompts' (68 blocks) and the third's (37).
    shared, alone = (index.walk(memory.ROOT, index.block_keys(prompts[i]))[0].block_hash % 2 for i in (0, 2))
    assert memory.shard_balance(index, 1) == 1.0
    assert memory.shard_balance(index, 2) == (68 / 52.5 if shared != alone else 2.0)
    result = memory.measure(trace, blocks=100, workers=2, shards=(1, 2))
    assert result["indexed_blocks"] == len(index) and result["prompts"] == used
    assert result["block_holds"] == len(index) + 64
    assert 16 < result["bytes_per_block"] < 10_000  # at least a hash and a pointer; far from a page


def test_the_name_table_floor_counts_each_name_and_its_dict_entry():
    floor = load_script("index_memory").name_table_floor(20_000)
    assert 8 + 28 < floor < 200  # more than the name's 8 bytes and its int object; a dict entry, not a page
