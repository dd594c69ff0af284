"""`make test`'s lint step and two pytest runs, one after the other, and the table of what each cost.

    python tests/tiers.py [--workers N] [PYTEST_ARGS...]

0. the lint tier, ``ruff check .``: the line length ([tool.ruff] in pyproject.toml: E501 at 120
   columns; under a second, the same as ``make lint``);
1. the unit tier, ``-m "not lab"`` (unit, golden, roles, vLLM parser, the tiny model served):
   spread over N pytest-xdist workers (default 2, one per core of CI's machine);
2. the lab tier, ``-m lab``: serial (one shared lab; its module fixtures deploy to it).

Both pytest tiers get PYTEST_ARGS and the environment (the VLLM_FLEET_REQUIRE_* flags come from the
Makefile). Every tier always runs; the exit status is 0 only when all exited 0: pytest's 5 (no test
collected) is a failure too. At the end: each tier's wall time and summary line (ruff's last line,
pytest's summary), the slowest module- and session-scoped fixture setups of the pytest tiers (the
lab's deploys; tests/conftest.py records them), and pytest's own --durations=25 is in each tier's
output above it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import fixture_table  # noqa: E402

# pytest's last line: "=== 1009 passed, 2 warnings in 312.4s ===" (without the rules under -q)
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+|no tests ran)\b.* in [0-9.]+s\b.*?)\s*=*$")


def tiers(workers: str, pytest_args: list[str]) -> list[tuple[str, list[str]]]:
    pytest = [sys.executable, "-m", "pytest", "--durations=25", "--durations-min=1"]
    return [
        ("lint  ruff check .", [sys.executable, "-m", "ruff", "check", "."]),
        (f'unit  -m "not lab" -n {workers}', [*pytest, "-m", "not lab", "-n", workers, *pytest_args]),
        ('lab   -m lab (serial)', [*pytest, "-m", "lab", *pytest_args]),
    ]


def summary_of(tail: str) -> str:
    """pytest's summary line, else the last line of the output (ruff's 'All checks passed!' / 'Found N errors.')."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return next(
        (m.group(1) for line in reversed(lines) if (m := SUMMARY.match(line))),
        lines[-1] if lines else "no output",
    )


def run_tier(argv: list[str], times_file: str) -> tuple[int, float, str]:
    """Run one tier, its output passed through as it comes; (exit status, wall seconds, summary line)."""
    env = {**os.environ, "VLLM_FLEET_FIXTURE_TIMES": times_file}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    tail = b""
    assert proc.stdout is not None
    while chunk := os.read(proc.stdout.fileno(), 65536):
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        tail = (tail + chunk)[-4096:]
    rc = proc.wait()
    return rc, time.monotonic() - t0, summary_of(tail.decode(errors="replace"))


def main(args: list[str]) -> int:
    workers = "2"
    if args[:1] == ["--workers"]:
        workers, args = args[1], args[2:]
    results, setups = [], []
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vf-tiers-") as tmp:
        for name, argv in tiers(workers, args):
            times_file = str(Path(tmp) / "fixtures.jsonl")
            Path(times_file).unlink(missing_ok=True)
            rc, wall, summary = run_tier(argv, times_file)
            results.append((name, rc, wall, summary))
            if Path(times_file).exists():
                setups += [
                    {**json.loads(line), "tier": name.split()[0]} for line in Path(times_file).read_text().splitlines()
                ]
    total = time.monotonic() - t_all
    print("\n" + "=" * 30 + " make test: wall time per tier " + "=" * 30)
    for name, rc, wall, summary in results:
        print(f"{name:<28} {wall:8.1f}s  ({wall / 60:4.1f} min)  exit {rc}  {summary}")
    print(f"{'all tiers':<28} {total:8.1f}s  ({total / 60:4.1f} min)")
    print("=" * 20 + " slowest module/session fixture setups (unit and lab) " + "=" * 20)
    for line in fixture_table(setups):
        print(line)
    failed = [name.split()[0] for name, rc, _, _ in results if rc != 0]
    if failed:
        lint = "; lint: `make lint` lists the lines over 120 columns" if "lint" in failed else ""
        print(
            f"make test: FAILED ({', '.join(failed)} tier{'s' if len(failed) > 1 else ''}; exit 5 is pytest's 'no "
            f"tests collected'{lint})"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
