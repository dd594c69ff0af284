"""`make test`'s two pytest runs, one after the other, and the table of what each cost.

    python tests/tiers.py [--workers N] [PYTEST_ARGS...]

1. the unit tier, ``-m "not lab"`` (unit, golden, roles, vLLM parser, the tiny model served):
   spread over N pytest-xdist workers (default 2, one per core of CI's machine);
2. the lab tier, ``-m lab``: serial (one shared lab; its module fixtures deploy to it).

Both get PYTEST_ARGS and the environment (the VLLM_FLEET_REQUIRE_* flags come from the Makefile).
Both always run; the exit status is 0 only when both exited 0: pytest's 5 (no test collected) is a
failure too. At the end: each tier's wall time and pytest summary line, the slowest module- and
session-scoped fixture setups of both tiers (the lab's deploys; tests/conftest.py records them),
and pytest's own --durations=25 is in each tier's output above it.
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


def tiers(workers: str) -> list[tuple[str, list[str]]]:
    return [
        (f'unit  -m "not lab" -n {workers}', ["-m", "not lab", "-n", workers]),
        ('lab   -m lab (serial)', ["-m", "lab"]),
    ]


def run_tier(argv: list[str], times_file: str) -> tuple[int, float, str]:
    """Run one pytest, its output passed through as it comes; (exit status, wall seconds, summary line)."""
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
    summary = next(
        (
            m.group(1)
            for line in reversed(tail.decode(errors="replace").splitlines())
            if (m := SUMMARY.match(line.strip()))
        ),
        "no pytest summary line",
    )
    return rc, time.monotonic() - t0, summary


def main(args: list[str]) -> int:
    workers = "2"
    if args[:1] == ["--workers"]:
        workers, args = args[1], args[2:]
    pytest = [sys.executable, "-m", "pytest", "--durations=25", "--durations-min=1"]
    results, setups = [], []
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vf-tiers-") as tmp:
        for name, tier_args in tiers(workers):
            times_file = str(Path(tmp) / "fixtures.jsonl")
            Path(times_file).unlink(missing_ok=True)
            rc, wall, summary = run_tier([*pytest, *tier_args, *args], times_file)
            results.append((name, rc, wall, summary))
            if Path(times_file).exists():
                setups += [
                    {**json.loads(line), "tier": name.split()[0]} for line in Path(times_file).read_text().splitlines()
                ]
    total = time.monotonic() - t_all
    print("\n" + "=" * 30 + " make test: wall time per tier " + "=" * 30)
    for name, rc, wall, summary in results:
        print(f"{name:<28} {wall:8.1f}s  ({wall / 60:4.1f} min)  exit {rc}  {summary}")
    print(f"{'both tiers':<28} {total:8.1f}s  ({total / 60:4.1f} min)")
    print("=" * 22 + " slowest module/session fixture setups (both tiers) " + "=" * 22)
    for line in fixture_table(setups):
        print(line)
    failed = [name.split()[0] for name, rc, _, _ in results if rc != 0]
    if failed:
        print(
            f"make test: FAILED ({', '.join(failed)} tier{'s' if len(failed) > 1 else ''}; exit 5 is pytest's 'no "
            "tests collected')"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
