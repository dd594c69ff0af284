"""`vllm-fleet rollout --max-fail` and the rollout's end (issue 36, item 4), with a recording runner
that plays pyinfra's child: it writes the per-host results file the way vllm_fleet.host.results does.
Default: the first failed replica stops the rollout (as before); --max-fail N goes on while at most
N replicas failed, the failed ones kept out of the upstream; a host failed inside a batch fails only
its replicas; the per-replica summary, exit codes 3 / 4 and the retry line (--limit their hosts)."""

from __future__ import annotations

import argparse
import shlex

import pytest

from test_rollout_plan import REPO, SPEC, _inventory
from vllm_fleet.commands import outcome
from vllm_fleet.commands.outcome import MaxFail
from vllm_fleet.commands.rollout import Rollout, RolloutError
from vllm_fleet.host import results as hostresults
from vllm_fleet.host.results import CHANGED, CONVERGED, FAILED, NOT_ATTEMPTED, HostResult


class Child:
    """pyinfra's child for each step: ``fail``: hosts whose update step fails (in pyinfra's run:
    only those hosts fail; the others of the step finish)."""

    def __init__(self, fail: set[str] = frozenset(), results: bool = True):
        self.fail, self.results, self.calls = set(fail), results, []

    def __call__(self, argv, env):
        limit = [argv[i + 1] for i, a in enumerate(argv) if a == "--limit"]
        step = env["VLLM_FLEET_ROLLOUT_STEP"]
        self.calls.append((step, ",".join(limit), env["VLLM_FLEET_UPSTREAM_DOWN"]))
        bad = [h for h in limit if step == "update" and h in self.fail]
        if self.results:
            hostresults.write(
                env[hostresults.RESULTS_ENV], [HostResult(h, FAILED if h in bad else CHANGED) for h in limit]
            )
        if bad:
            return 1, "".join(
                f"    [{h}] RuntimeError: {h}: vllm-x-0.service not healthy after 9 s (unit failed)\n" for h in bad
            )
        return 0, ""


def _ro(tmp_path, servers, child, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Rollout(
        _inventory(tmp_path, servers),
        str(SPEC),
        cwd=str(REPO),
        state_dir=str(tmp_path / "st"),
        runner=child,
        say=lambda m: None,
        **kw,
    )


def test_default_stops_at_the_first_failed_replica_and_says_which_were_not_attempted(tmp_path):
    child = Child(fail={"lab2"})
    res = _ro(tmp_path, ["lab1", "lab2", "lab3"], child).run()
    assert [(r.host, r.status) for r in res.replicas] == [
        ("lab1:0", CHANGED),
        ("lab2:0", FAILED),
        ("lab3:0", NOT_ATTEMPTED),
    ]
    assert "not healthy after 9 s" in res.replicas[1].reason
    assert not any("lab3" in c[1] for c in child.calls)
    assert outcome.exit_code(res.replicas, 1) == 3
    first = _ro(tmp_path / "b", ["lab1", "lab2", "lab3"], Child(fail={"lab1"})).run()
    assert outcome.exit_code(first.replicas, 1) == 4  # nothing updated


def test_max_fail_goes_on_with_the_failed_replica_kept_out_of_the_upstream(tmp_path):
    child = Child(fail={"lab2"})
    res = _ro(tmp_path, ["lab1", "lab2", "lab3", "lab4"], child, max_fail=MaxFail(count=1)).run()
    assert [(r.host, r.status) for r in res.replicas] == [
        ("lab1:0", CHANGED),
        ("lab2:0", FAILED),
        ("lab3:0", CHANGED),
        ("lab4:0", CHANGED),
    ]
    assert res.left_out == ["lab2:0"] and not res.ok
    # lab2 failed: no back-in step for it; every later step keeps it down, and it never returns
    seq = child.calls
    assert seq[3] == ("upstream", "lab1", "lab2:0") and seq[4] == ("update", "lab2", "lab2:0")
    assert seq[5] == ("upstream", "lab1", "lab2:0,lab3:0") and seq[6] == ("update", "lab3", "lab2:0,lab3:0")
    assert seq[7] == ("upstream", "lab1", "lab2:0")  # lab3 back in, lab2 still out
    assert seq[-1] == ("upstream", "lab1", "lab2:0")
    assert outcome.exit_code(res.replicas, 1) == 3
    # remembered: the next rollout starts with lab2
    again = _ro(tmp_path, ["lab1", "lab2", "lab3", "lab4"], Child())
    assert again.batches[0] == ["lab2:0"]


def test_max_fail_is_counted_over_the_replicas_and_stops_past_it(tmp_path):
    child = Child(fail={"lab2", "lab3"})
    res = _ro(tmp_path, ["lab1", "lab2", "lab3", "lab4"], child, max_fail=MaxFail(count=1)).run()
    assert [r.status for r in res.replicas] == [CHANGED, FAILED, FAILED, NOT_ATTEMPTED]
    assert "more than 1 replica(s) failed" in res.replicas[3].reason
    pct = _ro(
        tmp_path / "p", ["lab1", "lab2", "lab3", "lab4"], Child(fail={"lab2", "lab3"}), max_fail=MaxFail(percent=50)
    ).run()
    assert [r.status for r in pct.replicas] == [CHANGED, FAILED, FAILED, CHANGED]  # 2 of 4 is not more than 50 %


def test_a_host_failed_inside_a_batch_fails_only_its_replicas(tmp_path):
    child = Child(fail={"lab3"})
    res = _ro(tmp_path, ["lab1", "lab2", "lab3", "lab4", "lab5"], child, size=2, max_fail=MaxFail(count=1)).run()
    assert [(r.host, r.status) for r in res.replicas] == [
        ("lab1:0", CHANGED),
        ("lab2:0", CHANGED),
        ("lab3:0", FAILED),
        ("lab4:0", CHANGED),
        ("lab5:0", CHANGED),
    ]
    # batch 2 (lab3, lab4): lab4 back in, lab3 kept out
    assert ("upstream", "lab1", "lab3:0") in child.calls and ("update", "lab3,lab4", "lab3:0,lab4:0") in child.calls
    # without per-host results (an older child) the whole batch counts as failed
    res2 = _ro(
        tmp_path / "o",
        ["lab1", "lab2", "lab3", "lab4", "lab5"],
        Child(fail={"lab3"}, results=False),
        size=2,
        max_fail=MaxFail(count=2),
    ).run()
    assert [r.status for r in res2.replicas][2:4] == [FAILED, FAILED]


def test_a_batch_that_would_take_every_replica_out_with_the_failed_is_not_started(tmp_path):
    res = _ro(tmp_path, ["lab1", "lab2", "lab3"], Child(fail={"lab1"}), size=2, max_fail=MaxFail(count=5)).run()
    # batch 1 (lab1, lab2): lab1 failed; batch 2 (lab3) with lab1 out leaves lab2: fine; all three run
    assert [r.status for r in res.replicas] == [FAILED, CHANGED, CHANGED]
    res = _ro(
        tmp_path / "b", ["lab1", "lab2", "lab3"], Child(fail={"lab1", "lab2"}), size=2, max_fail=MaxFail(count=5)
    ).run()
    assert [r.status for r in res.replicas] == [FAILED, FAILED, NOT_ATTEMPTED]
    assert "every replica out of the upstream" in res.replicas[2].reason


def test_limit_takes_only_the_replicas_of_those_hosts(tmp_path):
    ro = _ro(tmp_path, ["lab1", "lab2", "lab3"], Child(), limit=["lab2"])
    assert ro.batches == [["lab2:0"]]
    res = ro.run()
    assert [(r.host, r.status) for r in res.replicas] == [("lab2:0", CHANGED)] and res.ok
    with pytest.raises(RolloutError, match="matches no host"):
        _ro(tmp_path, ["lab1", "lab2", "lab3"], Child(), limit=["nope"])


def test_the_cli_summary_and_retry_line(tmp_path, monkeypatch, capsys):
    from vllm_fleet.commands import rollout as rolloutcmd
    from vllm_fleet.commands.cli import build_parser

    inv = _inventory(tmp_path, ["lab1", "lab2", "lab3"])
    child = Child(fail={"lab2"})
    monkeypatch.setattr(rolloutcmd.Rollout, "_subprocess", lambda self, argv, env: child(argv, env))
    monkeypatch.setattr(rolloutcmd, "STATE_DIR", str(tmp_path / "st"))
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["rollout", inv, "--spec", str(SPEC), "--drain-timeout", "30"])
    assert args.max_fail == MaxFail(count=0)
    rc = rolloutcmd.cmd_rollout(args)
    out = capsys.readouterr().out
    assert rc == 3, out
    assert "vllm-fleet rollout: 3 replica(s): 1 failed, 1 not attempted, 1 changed, 0 converged" in out
    assert (
        "  failed:        lab2:0: drain, update, check failed: lab2: vllm-x-0.service not healthy after 9 s (unit "
        "failed)" in out
    )
    retry = out.split("retry only those: ", 1)[1].splitlines()[0]
    assert shlex.split(retry) == [
        "vllm-fleet",
        "rollout",
        inv,
        "--spec",
        str(SPEC),
        "--drain-timeout",
        "30",
        "--max-fail",
        "0",
        "--limit",
        "lab2",
        "--limit",
        "lab3",
    ]


class NginxFails(Child):
    """pyinfra's child whose upstream step fails when it marks ``down`` (nginx -t refused on the proxy)."""

    def __init__(self, down: str):
        super().__init__()
        self.down = down

    def __call__(self, argv, env):
        if env["VLLM_FLEET_ROLLOUT_STEP"] == "upstream" and env["VLLM_FLEET_UPSTREAM_DOWN"] == self.down:
            limit = [argv[i + 1] for i, a in enumerate(argv) if a == "--limit"]
            self.calls.append(("upstream", ",".join(limit), self.down))
            hostresults.write(env[hostresults.RESULTS_ENV], [HostResult(h, FAILED) for h in limit])
            return 1, "    [lab1] nginx: [emerg] unexpected end of file\n"
        return super().__call__(argv, env)


@pytest.mark.parametrize(
    "down, failed, reason, at",
    [  # batch 2 out of the upstream; batch 1 back into it
        ("lab2:0", "lab2:0", "taking it out of the upstream on lab1 failed: ", "out of the upstream"),
        ("", "lab1:0", "updated, but putting it back into the upstream failed: ", "back into the upstream"),
    ],
)
def test_an_nginx_change_on_the_proxy_that_fails_stops_the_rollout_with_the_batch_out(
    tmp_path, down, failed, reason, at
):
    said: list[str] = []
    ro = _ro(tmp_path, ["lab1", "lab2", "lab3"], NginxFails(down), max_fail=MaxFail(count=5))
    ro.say = said.append
    res = ro.run()
    by = {r.host: r for r in res.replicas}
    assert by[failed].status == FAILED and by[failed].reason.startswith(reason), by[failed]
    assert "unexpected end of file" in by[failed].reason
    assert not res.ok and res.left_out == [failed]  # it stays out, and the rollout stops despite --max-fail
    assert by["lab3:0"].status == NOT_ATTEMPTED
    assert by["lab3:0"].reason == "the rollout stopped (the nginx change on lab1 failed)"
    assert any(f"FAILED at `{at}`" in m for m in said), said


def test_each_failed_replica_of_a_batch_says_its_own_hosts_reason(tmp_path):
    """Two hosts of one batch fail for different reasons (pyinfra's child records each host's:
    vllm_fleet.host.results): each replica's line says its host's, not the batch output's first
    error line (bench/fleet_faults.py on the lab: lab7's vLLM that never got healthy was reported
    with lab6's full disk, and a powered-off host with a line of pyinfra's results table)."""
    why = {"lab2": "could not connect (pyinfra's output above says why)", "lab3": "host lab3: not enough disk space"}

    def child(argv, env):
        limit = [argv[i + 1] for i, a in enumerate(argv) if a == "--limit"]
        bad = [h for h in limit if env["VLLM_FLEET_ROLLOUT_STEP"] == "update" and h in why]
        hostresults.write(
            env[hostresults.RESULTS_ENV],
            [HostResult(h, FAILED, why[h]) if h in bad else HostResult(h, CHANGED) for h in limit],
        )
        out = (
            "    Operation   Hosts   Success   Error   No Change\n    [lab3] Error: host lab3: not enough disk space\n"
        )
        return (1, out) if bad else (0, "")

    res = _ro(tmp_path, ["lab1", "lab2", "lab3", "lab4"], child, max_fail=MaxFail(count=2), size=2).run()
    got = {r.host: (r.status, r.reason) for r in res.replicas}
    assert got["lab2:0"] == (FAILED, f"drain, update, check failed: {why['lab2']}")
    assert got["lab3:0"] == (FAILED, f"drain, update, check failed: {why['lab3']}")
    assert got["lab1:0"][0] == CHANGED and got["lab4:0"][0] == CHANGED
