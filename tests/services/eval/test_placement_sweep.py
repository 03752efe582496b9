"""scripts/placement_sweep.py: the judgement on constructed cells, and one small sweep end
to end (real `svc sim` processes)."""
from __future__ import annotations

import json

from tests.scripts import load_script


def test_a_cell_passes_only_when_every_seed_is_within_tolerance_of_its_best_baseline():
    sweep = load_script("placement_sweep")
    # Seed 0: lpm is the best baseline on the mean, cache_aware on the p99.
    cell = sweep.Cell("chat", "4", {0: {"lpm": (1.0, 9.0), "cache_aware": (2.0, 4.0), "e2": (3.0, 6.0),
                                        "new": (1.04, 4.1)},
                                    1: {"lpm": (1.0, 9.0), "cache_aware": (2.0, 4.0), "e2": (3.0, 6.0),
                                        "new": (1.0, 4.0)}})
    verdict = sweep.judge(cell, "new", ("lpm", "cache_aware"), "e2", 0.05)
    assert verdict.best_baseline == ("lpm", "cache_aware")
    assert abs(verdict.ratio[0] - 1.04) < 1e-9 and abs(verdict.ratio[1] - 4.1 / 4.0) < 1e-9
    assert abs(verdict.vs_reference[0] - 1.04 / 3.0) < 1e-9 and verdict.passed
    cell.by_seed[1]["new"] = (1.06, 4.0)  # one seed 6 % behind on the mean fails the cell
    assert not sweep.judge(cell, "new", ("lpm", "cache_aware"), "e2", 0.05).passed


def test_a_small_sweep_runs_each_group_once_and_writes_the_table_and_plot(tmp_path, capsys):
    sweep = load_script("placement_sweep")
    out, table, figure = tmp_path / "runs", tmp_path / "table.md", tmp_path / "sweep.png"
    arguments = ["--out", str(out), "--workloads", "toolbench", "--loads", "0.8,2", "--seeds", "0",
                 "--workers", "2", "--profile", "", "--num-requests", "30", "--baselines", "lpm,round_robin",
                 "--jobs", "2", "--markdown", str(table), "--plot", str(figure)]
    status = sweep.main(arguments)
    runs = sorted(path.name for path in out.iterdir())
    assert runs == ["toolbench_s0_baselines.json", "toolbench_s0_cost_aware.json"]
    baselines = json.loads((out / runs[0]).read_text())
    assert set(baselines["values"]) == {"0.8", "2"}
    assert set(baselines["values"]["2"]) == {"lpm", "round_robin", "e2"}
    rows = [line for line in table.read_text().splitlines() if line.startswith("| toolbench |")]
    assert [row.split(" | ")[1] for row in rows] == ["0.8", "2"]
    for written in (figure, tmp_path / "sweep_p99.png"):
        assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    verdicts = ["yes" in row.rsplit("|", 2)[1] for row in rows]
    assert status == (0 if all(verdicts) else 1)
    # A second call finds both runs and reruns neither: the files keep their contents.
    before = {name: (out / name).stat().st_mtime_ns for name in runs}
    assert sweep.main(arguments) == status
    assert {name: (out / name).stat().st_mtime_ns for name in runs} == before
    capsys.readouterr()
