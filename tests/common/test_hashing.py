import subprocess
import sys
from pathlib import Path

from common.hashing import block_hash, chain_hashes, root_hash

ROOT_ARGS = ("model-fp", "tok-fp", "", "bfloat16", 16)


def test_chain_names_only_full_blocks_and_extends_consistently():
    root = root_hash(*ROOT_ARGS)
    tokens = list(range(100, 150))  # 3 full blocks of 16 and 2 spare tokens
    hashes = chain_hashes(root, tokens, 16)
    assert len(hashes) == 3
    assert hashes[0] == block_hash(root, tokens[:16])
    assert hashes[2] == block_hash(hashes[1], tokens[32:48])
    # Extending a chain from its last hash equals hashing the whole prefix at once.
    assert hashes[:1] + chain_hashes(hashes[0], tokens[16:], 16) == hashes


def test_shared_prefix_shares_names_and_divergence_breaks_the_chain():
    root = root_hash(*ROOT_ARGS)
    a = list(range(64))
    b = list(range(32)) + [999] + list(range(33, 64))
    ha, hb = chain_hashes(root, a, 16), chain_hashes(root, b, 16)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]  # same tokens in block 3, different parent


def test_root_is_namespaced_by_every_identity_field():
    base = root_hash(*ROOT_ARGS)
    variants = [
        root_hash("other-model", "tok-fp", "", "bfloat16", 16),
        root_hash("model-fp", "other-tok", "", "bfloat16", 16),
        root_hash("model-fp", "tok-fp", "lora-1", "bfloat16", 16),
        root_hash("model-fp", "tok-fp", "", "float32", 16),
        root_hash("model-fp", "tok-fp", "", "bfloat16", 32),
        root_hash(*ROOT_ARGS, tenant_salt="tenant-a"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_hash_is_stable_across_processes():
    here = chain_hashes(root_hash(*ROOT_ARGS), list(range(64)), 16)
    code = ("from common.hashing import chain_hashes, root_hash;"
            f"print(chain_hashes(root_hash(*{ROOT_ARGS!r}), list(range(64)), 16))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345"}, cwd=Path(__file__).parents[2])
    assert other.stdout.strip() == str(here)


def test_a_list_an_array_and_a_tuple_of_the_same_ids_get_the_same_names():
    import numpy as np

    root = root_hash(*ROOT_ARGS)
    tokens = [0, 1, 2**32 - 1, 70_000] * 12
    from_list = chain_hashes(root, tokens, 16)
    assert from_list == chain_hashes(root, np.array(tokens, dtype=np.int64), 16)
    assert from_list == chain_hashes(root, tuple(tokens), 16)
    assert from_list[0] == block_hash(root, tokens[:16])
