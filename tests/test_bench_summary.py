"""bench/summary.py: the one table `make bench` ends with, from the benchmarks' JSON files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import summary  # noqa: E402


def test_table_has_medians_and_load_per_run(tmp_path, capsys):
    runs = [
        {"rc": 0, "wall_s": w, "phases": {"smoke_s": 0.4}, "loadavg1_before": la}
        for w, la in ((2.0, 0.5), (3.0, 0.7), (2.5, 0.6))
    ]
    (tmp_path / "lab-deploy-scaling.json").write_text(
        json.dumps(
            {
                "sizes": {
                    "1": {
                        "hosts": 1,
                        "machine_before": {"loadavg_1_5_15": [1.5, 1, 1]},
                        "first_deploy": {"wall_s": 400.0, "kind": "cold"},
                        "noop_runs": runs + [{"rc": 1, "wall_s": 99.0}],
                    }
                }
            }
        )
    )
    assert summary.main(["--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    noop = next(line for line in out.splitlines() if "no-op" in line).split()
    # median 2.5, min 2.0, max 3.0 of the 3 runs that passed (the failed run is not counted)
    assert noop[-6:] == ["2.5", "2.0", "3.0", "3", "s", "0.50-0.70"], noop
    assert "deploy: cold" in out and "400.0" in out
    assert "no lab-serve-latency.json" in out
