"""scripts/profile_shares.py: a sample counts for the innermost Baton frame of its stack,
and only samples through the loop named count."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.local_cluster import REPO
from tests.scripts import load_script

RUN = "Simulator._run (services/eval/simulator.py:345)"
# py-spy raw lines: frames outermost first, then the sample count
PROFILE = "\n".join([
    f"main (services/cli.py:10);{RUN};PrefixIndex.stored (services/router/index.py:330);"
    "CPyDef_index___PrefixIndex____hold;_Py_dict_lookup 6",
    f"main (services/cli.py:10);{RUN};BlockManager.release (common/engine/block_manager.py:250);"
    "_Py_dict_lookup 3",
    f"main (services/cli.py:10);{RUN};Simulator._step_done (services/eval/simulator.py:680) 1",
    f"main (services/cli.py:10);{RUN};gc_collect_main 2",
    f"main (services/cli.py:10);{RUN};PyThread_acquire_lock_timed 1",
    "main (services/cli.py:10);generate (services/eval/workloads/mooncake.py:40) 50",
    "",
])


def test_samples_count_for_their_innermost_baton_frame_within_the_loop():
    shares = load_script("profile_shares")
    total, by_component = shares.shares(PROFILE.splitlines(), "Simulator._run")
    assert total == 13  # the trace's generation is outside the loop
    assert by_component == pytest.approx({
        "compiled:index": 6 / 13,  # the compiled frame, not the Python one above it
        "common/engine/block_manager.py": 3 / 13,  # its dictionary lookup counts for it
        "gc": 2 / 13,
        "services/eval/simulator.py": 1 / 13 + 1 / 13,  # the loop's own line, and a wait in it
    })
    assert list(by_component)[0] == "compiled:index"


def test_a_line_that_is_not_a_raw_profile_is_named():
    shares = load_script("profile_shares")
    with pytest.raises(ValueError, match="line 2"):
        shares.shares([f"{RUN} 1", "not a profile"], "Simulator._run")


def test_the_bound_is_the_share_left_when_the_named_parts_are_free(tmp_path):
    profile = tmp_path / "run.raw"
    profile.write_text(PROFILE)
    done = subprocess.run([sys.executable, "scripts/profile_shares.py", str(profile), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    report = json.loads(done.stdout)
    assert report["samples"] == 13
    assert report["left"] == pytest.approx(4 / 13)  # all but the index's 6 and the block manager's 3
    missing = subprocess.run([sys.executable, "scripts/profile_shares.py", str(profile), "--within", "nowhere"],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
    assert missing.returncode != 0 and "no sample passes through 'nowhere'" in missing.stderr
    misspelt = subprocess.run([sys.executable, "scripts/profile_shares.py", str(profile), "--free", "compiled:indx"],
                              capture_output=True, text=True, cwd=REPO, timeout=60)
    assert misspelt.returncode != 0 and "--free names no component of this profile: compiled:indx" in misspelt.stderr
