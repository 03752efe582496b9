"""scripts/live_placement_check.py: lowering the engines' priority, on a real process."""
from __future__ import annotations

import os
import select
import subprocess
import sys

from tests.scripts import load_script


def test_lower_priority_lowers_every_thread_of_the_process():
    threads = "import threading, time; [threading.Thread(target=time.sleep, args=(60,), daemon=True).start() " \
              "for _ in range(2)]; print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", threads], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert select.select([child.stdout], [], [], 30)[0], "the child never started its threads"
        assert child.stdout.readline().strip() == "ready"
        tids = [int(tid) for tid in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 3
        before = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}
        load_script("live_placement_check").lower_priority(child.pid, 5)
        assert {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in tids} == \
            {tid: min(19, nice + 5) for tid, nice in before.items()}
    finally:
        child.kill()
        child.wait(timeout=10)
