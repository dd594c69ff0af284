"""How a fleet command ends (issue 36, item 4): --max-fail, pyinfra's --fail-percent for it, the
exit codes, the per-host summary and the retry line (vllm_fleet.commands.outcome); and the
per-host results of a real pyinfra run on @fake hosts (vllm_fleet.host.results): a host failed
while the deploy is planned (fail_host, pyinfra's state.fail_hosts) leaves the others running."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fleet.commands import outcome
from vllm_fleet.commands.outcome import MaxFail, parse_max_fail
from vllm_fleet.host.results import CHANGED, CONVERGED, FAILED, NOT_ATTEMPTED, WOULD_CHANGE, HostResult


# -- --max-fail -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ("0", MaxFail(count=0)),
        ("3", MaxFail(count=3)),
        ("10%", MaxFail(percent=10)),
        (" 0% ", MaxFail(percent=0)),
        ("100%", MaxFail(percent=100)),
    ],
)
def test_max_fail_parses_a_count_or_a_whole_percentage(text, want):
    assert parse_max_fail(text) == want


@pytest.mark.parametrize("text", ["", "-1", "1.5", "12.5%", "101%", "ten", "%", "5%%", "0x3"])
def test_a_bad_max_fail_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_max_fail(text)


def test_a_bad_max_fail_is_a_usage_error_exit_2(capsys):
    p = argparse.ArgumentParser()
    outcome.add_run_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--max-fail", "12.5%"])
    assert e.value.code == 2 and "whole percentage" in capsys.readouterr().err


def test_max_fail_is_exceeded_past_the_limit_not_at_it():
    # Ansible's max_fail_percentage: the run stops when MORE than the limit failed
    assert not MaxFail(count=2).exceeded(2, 10) and MaxFail(count=2).exceeded(3, 10)
    assert not MaxFail(percent=25).exceeded(1, 4) and MaxFail(percent=25).exceeded(2, 4)
    assert MaxFail(count=0).exceeded(1, 100) and not MaxFail(count=0).exceeded(0, 100)
    assert not MaxFail(percent=0).exceeded(0, 3) and MaxFail(percent=0).exceeded(1, 3)


def _pyinfra_stops(fail_percent: int, failed: int, total: int) -> bool:
    """pyinfra 3.10's own test (pyinfra/api/state.py fail_hosts), float arithmetic and all."""
    active = total - failed
    return active == 0 or (1 - active / total) * 100 > fail_percent


@pytest.mark.parametrize("total", range(1, 100))
def test_a_count_becomes_a_fail_percent_pyinfra_stops_at_exactly(total):
    for n in range(0, total + 1):
        q, exact = MaxFail(count=n).fail_percent(total)
        assert exact
        for failed in range(1, total):  # pyinfra always stops when none is left
            assert _pyinfra_stops(q, failed, total) == (failed > n), (n, total, failed, q)


def test_a_count_of_many_hosts_is_rounded_to_a_whole_percent_and_said():
    q, exact = MaxFail(count=1).fail_percent(500)
    assert not exact and q == 1 and not _pyinfra_stops(q, 1, 500)  # never stops before N+1
    said: list[str] = []
    flags = outcome.pyinfra_run_flags(argparse.Namespace(max_fail=MaxFail(count=1), parallel=8), 500, said.append)
    assert flags == ["--fail-percent", "1", "--parallel", "8"] and "whole percents" in said[0]
    assert outcome.pyinfra_run_flags(argparse.Namespace(max_fail=None, parallel=None), 3) == []


# -- exit codes ---------------------------------------------------------------------------------


def R(host, status, reason=""):
    return HostResult(host, status, reason)


def test_exit_codes():
    assert outcome.exit_code([R("a", CONVERGED), R("b", CHANGED)]) == outcome.EXIT_OK == 0
    assert outcome.exit_code([R("a", WOULD_CHANGE)]) == 0
    assert outcome.exit_code([R("a", CHANGED), R("b", FAILED, "x")], 1) == outcome.EXIT_SOME_FAILED == 3
    assert outcome.exit_code([R("a", CHANGED), R("b", NOT_ATTEMPTED)], 1) == 3
    assert outcome.exit_code([R("a", FAILED), R("b", NOT_ATTEMPTED)], 1) == outcome.EXIT_NOTHING_DONE == 4
    assert outcome.exit_code([], 1) == 4
    assert outcome.exit_code(None, 1) == 3  # no results: some host failed, which is not known
    assert outcome.exit_code(None, 0) == 0
    assert outcome.exit_code([R("a", CHANGED)], 1) == 3  # pyinfra failed although every host finished
    assert outcome.exit_code([R("a", CHANGED)], 130) == 130
    # distinct from "bad spec, nothing changed" and usage
    assert (
        len(
            {
                outcome.EXIT_OK,
                outcome.EXIT_INPUT,
                outcome.EXIT_USAGE,
                outcome.EXIT_SOME_FAILED,
                outcome.EXIT_NOTHING_DONE,
                outcome.EXIT_INTERRUPTED,
            }
        )
        == 6
    )


# -- the retry line and the summary ---------------------------------------------------------------


def test_the_retry_line_repeats_the_users_arguments_on_the_failed_hosts_only():
    line = outcome.retry_line(
        "deploy",
        ["inventory/lab.py"],
        [
            ("--spec", "my specs/a.yaml"),
            ("--data", "ssh_user=lab"),
            ("--limit", "servers"),
            ("--verify", None),
            ("-y", None),
        ],
        ["lab2", "lab 3"],
    )
    argv = shlex.split(line)
    assert argv == [
        "vllm-fleet",
        "deploy",
        "inventory/lab.py",
        "--spec",
        "my specs/a.yaml",
        "--data",
        "ssh_user=lab",
        "--limit",
        "lab2",
        "--limit",
        "lab 3",
        "--verify",
        "-y",
    ]


def test_the_summary_names_each_host_its_status_and_why():
    results = [
        R("lab1", CHANGED),
        R("lab2", FAILED, "host lab2: no space for the model (needs 2 GiB, 1 GiB free)"),
        R("lab3", CONVERGED),
        R("lab4", NOT_ATTEMPTED, "the run stopped before any operation ran"),
    ]
    lines = outcome.summary_lines("deploy", results, retry="vllm-fleet deploy inv.py --limit lab2 --limit lab4 -y")
    text = "\n".join(lines)
    assert lines[0] == "vllm-fleet deploy: 4 host(s): 1 failed, 1 not attempted, 1 changed, 1 converged"
    assert "  failed:        lab2: host lab2: no space for the model (needs 2 GiB, 1 GiB free)" in lines
    assert "  not attempted: lab4 (the run stopped before any operation ran)" in lines
    assert "  changed:       lab1" in lines and "  converged:     lab3" in lines
    assert lines[-1] == "  retry only those: vllm-fleet deploy inv.py --limit lab2 --limit lab4 -y"
    ok = outcome.summary_lines("deploy", [R("lab1", CONVERGED)], retry="never shown")
    assert "retry" not in "\n".join(ok) and ok[0] == "vllm-fleet deploy: 1 host(s): 0 failed, 0 changed, 1 converged"
    assert outcome.retry_hosts(results) == ["lab2", "lab4"]


# -- a real pyinfra run: per-host results, a host failed while planning ----------------------------

DEPLOY = """
from pyinfra import host
from pyinfra.operations import server
from vllm_fleet.host.results import fail_host

if host.name in {planning}:
    fail_host(host, f"host {{host.name}}: no space for the model\\nsecond line")
else:
    server.shell(name="Change something", commands=["echo change"])
"""

INVENTORY = """
servers = [
    ("@fake/a", {{}}),
    ("@fake/b", {{}}),
    ("@fake/c", {{"fake_responses": {{"echo change": {{"success": False, "stderr": "disk full"}}}}}}),
    ("@fake/d", {{}}),
]
"""


def _run(tmp_path: Path, planning: list[str], *extra: str) -> tuple[int, list[HostResult] | None, str]:
    (tmp_path / "inv.py").write_text(INVENTORY.format())
    (tmp_path / "deploy.py").write_text(DEPLOY.format(planning=repr(set(planning))))
    results = tmp_path / "results.json"
    env = {
        **os.environ,
        "VLLM_FLEET_RESULTS": str(results),
        "PYINFRA_FAKE_DELAY": "0",
        "PYINFRA_FAKE_DELAY_JITTER": "0",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet.host.pyinfra_run", "inv.py", "deploy.py", "-y", *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode, outcome.read_results(str(results)), r.stdout + r.stderr


def test_a_host_failed_while_planning_stops_only_itself(tmp_path):
    rc, results, out = _run(tmp_path, ["@fake/b"])
    assert rc == 1, out
    by = {r.host: r for r in results}
    assert by["@fake/a"].status == CHANGED and by["@fake/d"].status == CHANGED, out
    assert by["@fake/b"] == R("@fake/b", FAILED, "host @fake/b: no space for the model")  # its first line
    assert by["@fake/c"].status == FAILED and by["@fake/c"].reason == "`Change something` failed: disk full"
    assert "no space for the model" in out  # printed by pyinfra's logger, with the host's prefix
    assert outcome.exit_code(results, rc) == 3
    assert not (tmp_path / "results.json").exists()  # read_results removed it


def test_fail_percent_stops_the_run_and_the_rest_is_not_attempted(tmp_path):
    rc, results, out = _run(tmp_path, ["@fake/b"], "--fail-percent", "0")
    assert rc == 1 and "Over 0% of hosts failed" in out, out
    by = {r.host: r.status for r in results}
    assert by["@fake/b"] == FAILED and {by[h] for h in ("@fake/a", "@fake/c", "@fake/d")} == {NOT_ATTEMPTED}, results
    assert outcome.exit_code(results, rc) == 4


def test_a_dry_run_says_what_would_change(tmp_path):
    rc, results, out = _run(tmp_path, ["@fake/b"], "--dry")
    by = {r.host: r.status for r in results}
    assert by == {"@fake/a": WOULD_CHANGE, "@fake/b": FAILED, "@fake/c": WOULD_CHANGE, "@fake/d": WOULD_CHANGE}, out


def test_every_host_failed_is_nothing_done(tmp_path):
    rc, results, out = _run(tmp_path, ["@fake/a", "@fake/b", "@fake/c", "@fake/d"])
    assert rc == 1 and {r.status for r in results} == {FAILED}, out
    assert outcome.exit_code(results, rc) == 4


# -- deploy's end: flags to pyinfra, the summary, the retry line, the endpoints that serve ----------

THREE = (
    'servers = [("gpu1", {"ssh_hostname": "192.0.2.10", "ssh_user": "root"}), '
    '("gpu2", {"ssh_hostname": "192.0.2.11", "ssh_user": "root"}), ("gpu3", {"ssh_hostname": "192.0.2.12", '
    '"ssh_user": "root"})]\n'
    'proxy = ["gpu1"]\n'
)


def _deploy_args(inv, spec, *extra):
    from vllm_fleet.commands.cli import build_parser

    return build_parser().parse_args(["deploy", str(inv), "--spec", str(spec), "-y", *extra])


def test_deploy_passes_max_fail_and_parallel_to_pyinfra_and_ends_with_the_summary(tmp_path, capsys, monkeypatch):
    from test_fleet_commands import _inventory, _spec
    from vllm_fleet.commands import deploy as deploycmd
    from vllm_fleet.host import results as hostresults

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec, inv = _spec(tmp_path, server={"host": "0.0.0.0"}), _inventory(tmp_path, THREE)
    args = _deploy_args(inv, spec, "--max-fail", "1", "--parallel", "2", "--data", "x=1")
    seen: dict = {}

    def fake_run(argv, what, again, env=None):  # the pyinfra child: gpu3 failed while planned
        seen["argv"] = argv
        hostresults.write(
            env[hostresults.RESULTS_ENV],
            [
                HostResult("gpu1", CHANGED),
                HostResult("gpu2", CONVERGED),
                HostResult("gpu3", FAILED, "host gpu3: user x cannot run sudo"),
            ],
        )
        return 1

    monkeypatch.setattr("vllm_fleet.host.pyinfra_run.run", fake_run)
    rc = deploycmd.cmd_deploy(args)
    out, err = capsys.readouterr()
    assert "argv" in seen, (rc, out, err)
    argv = seen["argv"]
    assert (
        argv[argv.index("--fail-percent") + 1] == "66" and argv[argv.index("--parallel") + 1] == "2"
    )  # 1 of 3: stop at 2
    assert rc == 3
    assert "  failed:        gpu3: host gpu3: user x cannot run sudo" in err
    retry = next(ln for ln in err.splitlines() if "retry only those:" in ln).split("retry only those: ", 1)[1]
    assert shlex.split(retry) == [
        "vllm-fleet",
        "deploy",
        str(inv),
        "--spec",
        str(spec),
        "--data",
        "x=1",
        "--max-fail",
        "1",
        "--parallel",
        "2",
        "--limit",
        "gpu3",
        "-y",
    ]
    assert "serves 'tiny' on gpu1, gpu2, gpu3" not in out
    assert "lab-tiny serves 'tiny' on gpu1, gpu2 (not on gpu3: failed or not attempted)" in out  # gpu1 is its proxy


def test_deploy_whose_proxy_failed_says_the_endpoint_does_not_serve(tmp_path, capsys, monkeypatch):
    from test_fleet_commands import _inventory, _spec
    from vllm_fleet.commands import deploy as deploycmd
    from vllm_fleet.host import results as hostresults

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec, inv = _spec(tmp_path, server={"host": "0.0.0.0"}), _inventory(tmp_path, THREE)

    def fake_run(argv, what, again, env=None):
        hostresults.write(
            env[hostresults.RESULTS_ENV],
            [HostResult("gpu1", FAILED, "no space"), HostResult("gpu2", CHANGED), HostResult("gpu3", CHANGED)],
        )
        return 1

    monkeypatch.setattr("vllm_fleet.host.pyinfra_run.run", fake_run)
    assert deploycmd.cmd_deploy(_deploy_args(inv, spec)) == 3
    out = capsys.readouterr().out
    assert "lab-tiny: not serving at http://192.0.2.10/v1: gpu1 did not finish" in out and "endpoint:" not in out


def test_deploy_with_every_host_failed_is_nothing_done_and_names_no_endpoint(tmp_path, capsys, monkeypatch):
    from test_fleet_commands import _inventory, _spec
    from vllm_fleet.commands import deploy as deploycmd
    from vllm_fleet.host import results as hostresults

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec, inv = _spec(tmp_path, server={"host": "0.0.0.0"}), _inventory(tmp_path, THREE)

    def fake_run(argv, what, again, env=None):
        hostresults.write(env[hostresults.RESULTS_ENV], [HostResult(h, FAILED, "x") for h in ("gpu1", "gpu2", "gpu3")])
        return 1

    monkeypatch.setattr("vllm_fleet.host.pyinfra_run.run", fake_run)
    assert deploycmd.cmd_deploy(_deploy_args(inv, spec)) == 4
    out, err = capsys.readouterr()
    assert "endpoint" not in out and "3 failed" in err and "--limit gpu1 --limit gpu2 --limit gpu3" in err


def test_a_retry_on_a_server_only_leaves_the_proxy_outside_the_run_serving(tmp_path, capsys, monkeypatch):
    from test_fleet_commands import _inventory, _spec
    from vllm_fleet.commands import deploy as deploycmd
    from vllm_fleet.host import results as hostresults

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec, inv = _spec(tmp_path, server={"host": "0.0.0.0"}), _inventory(tmp_path, THREE)

    def fake_run(argv, what, again, env=None):
        hostresults.write(env[hostresults.RESULTS_ENV], [HostResult("gpu3", CONVERGED)])
        return 0

    monkeypatch.setattr("vllm_fleet.host.pyinfra_run.run", fake_run)
    assert deploycmd.cmd_deploy(_deploy_args(inv, spec, "--limit", "gpu3")) == 0
    out = capsys.readouterr().out
    assert (
        "lab-tiny serves 'tiny' on gpu3" in out
        and "endpoint:  http://192.0.2.10/v1" in out
        and "not serving" not in out
    )


def test_the_summary_names_only_the_hosts_that_hold_a_part_of_the_deployment(tmp_path, capsys, monkeypatch):
    """A host of the inventory the layout gives nothing of this deployment (gpu3, only in
    ray_workers of a one-node spec) is neither said to serve it nor listed as failed."""
    from test_fleet_commands import _inventory, _spec
    from vllm_fleet.commands import deploy as deploycmd
    from vllm_fleet.host import results as hostresults

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spare = (
        THREE.replace(', ("gpu3", {"ssh_hostname": "192.0.2.12", "ssh_user": "root"})]', "]")
        + 'ray_workers = [("gpu3", {"ssh_hostname": "192.0.2.12", "ssh_user": "root"})]\n'
    )
    spec, inv = _spec(tmp_path, server={"host": "0.0.0.0"}), _inventory(tmp_path, spare)

    def fake_run(argv, what, again, env=None):
        hostresults.write(env[hostresults.RESULTS_ENV], [HostResult(h, CONVERGED) for h in ("gpu1", "gpu2", "gpu3")])
        return 0

    monkeypatch.setattr("vllm_fleet.host.pyinfra_run.run", fake_run)
    assert deploycmd.cmd_deploy(_deploy_args(inv, spec)) == 0
    out = capsys.readouterr().out
    assert "lab-tiny serves 'tiny' on gpu1, gpu2\n" in out and "gpu3" not in out, out
