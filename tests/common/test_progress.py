"""common/progress.py: what a long step prints where no terminal shows a bar."""
import io
import time

from common.progress import LineProgress, heartbeat


def test_line_progress_writes_a_line_per_interval_and_one_at_the_end():
    stream = io.StringIO()
    with LineProgress(total=5, desc="profile", unit="point", every_s=0.05, stream=stream) as lines:
        lines.update()  # sooner than every_s after the start: no line
        time.sleep(0.06)
        lines.update(2)
    assert stream.getvalue().splitlines() == ["profile: 3/5 points, 0 s", "profile: 3/5 points, 0 s"]


def test_heartbeat_beats_while_the_body_runs_and_stops_after():
    stream = io.StringIO()
    with heartbeat("building", every_s=0.05, stream=stream):
        time.sleep(0.18)
    beats = stream.getvalue().splitlines()
    assert 2 <= len(beats) <= 4 and all(line.startswith("building: ") for line in beats)
    time.sleep(0.1)
    assert stream.getvalue().splitlines() == beats  # its thread ended with the body


def test_a_quick_step_prints_nothing():
    stream = io.StringIO()
    with heartbeat("quick", every_s=1.0, stream=stream):
        pass
    assert stream.getvalue() == ""
