"""`vllm-fleet stage` (vllm_fleet/commands/stage.py): the inputs checked as deploy checks them,
then pyinfra with the packaged stage deploy (host data nvidia_reboot=False), and the end every
fleet command has (vllm_fleet.commands.outcome: per-host summary, retry line, exit codes)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleet_commands import ONE_HOST, Recorder, _args, _inventory, _spec  # noqa: E402

from vllm_fleet.commands import stage as stagemod


def test_stage_runs_the_packaged_stage_deploy_without_reboots(tmp_path, capsys):
    run = Recorder()
    rc = stagemod.cmd_stage(
        _args(_inventory(tmp_path, ONE_HOST), spec=str(_spec(tmp_path)), limit=["gpu1"]), runner=run
    )
    assert rc == 0
    (argv,) = run.calls
    assert argv[2] == "vllm_fleet.deploys.stage.stage"
    assert "nvidia_reboot=False" in argv and argv[argv.index("nvidia_reboot=False") - 1] == "--data"
    assert "on 1 host(s)" in capsys.readouterr().err


def test_a_bad_spec_contacts_no_host(tmp_path, capsys):
    run = Recorder()
    rc = stagemod.cmd_stage(_args(_inventory(tmp_path, ONE_HOST), spec=str(tmp_path / "missing.yaml")), runner=run)
    assert rc == 1 and run.calls == []
    assert "nothing was staged; no host was contacted" in capsys.readouterr().err


def test_max_fail_and_parallel_are_pyinfras_flags(tmp_path):
    from vllm_fleet.commands.outcome import parse_max_fail

    run = Recorder(rc=1)
    rc = stagemod.cmd_stage(
        _args(_inventory(tmp_path, ONE_HOST), spec=str(_spec(tmp_path)), max_fail=parse_max_fail("10%"), parallel=4),
        runner=run,
    )
    assert rc == 3  # pyinfra failed and wrote no results
    (argv,) = run.calls
    assert argv[argv.index("--fail-percent") + 1] == "10" and argv[argv.index("--parallel") + 1] == "4"


def test_the_run_ends_with_the_per_host_summary_the_retry_line_and_its_exit_code(tmp_path, capsys, monkeypatch):
    """The pyinfra child's per-host results (vllm_fleet.host.results, the file $VLLM_FLEET_RESULTS
    names) become outcome's summary: a failed host with why, the retry line on it alone, exit 3."""
    from vllm_fleet.host import pyinfra_run, results

    inv = _inventory(
        tmp_path,
        'servers = [("gpu1", {"ssh_hostname": "192.0.2.10"}), ("gpu2", {"ssh_hostname": "192.0.2.11"}),'
        ' ("gpu3", {"ssh_hostname": "192.0.2.12"})]\nproxy = ["gpu1"]\n',
    )
    spec = _spec(tmp_path, server={"host": "0.0.0.0"})
    seen = {}

    def fake_run(argv, what, again, env=None):
        seen["argv"] = argv
        results.write(
            env[results.RESULTS_ENV],
            [
                results.HostResult("gpu1", results.CHANGED),
                results.HostResult("gpu2", results.FAILED, "`vLLM | pip install` failed: No space left"),
                results.HostResult("gpu3", results.CONVERGED),
            ],
        )
        return 1

    monkeypatch.setattr(pyinfra_run, "run", fake_run)
    rc = stagemod.cmd_stage(_args(inv, spec=str(spec), max_fail=None, parallel=None))
    out = capsys.readouterr().out
    assert rc == 3
    assert "vllm-fleet stage: 3 host(s): 1 failed, 1 changed, 1 converged" in out
    assert "failed:        gpu2: `vLLM | pip install` failed: No space left" in out
    retry = next(ln for ln in out.splitlines() if "retry only those:" in ln)
    # pasteable as printed: the -y the user gave comes with it (without, a shell with no terminal
    # gets exit 2, "no terminal to confirm": bench/fleet_faults.py ran into it)
    assert retry.endswith(f"vllm-fleet stage {inv} --spec {spec} --limit gpu2 -y")
    assert seen["argv"][2] == "vllm_fleet.deploys.stage.stage"


def test_the_summary_lists_the_hosts_the_layout_stages(tmp_path):
    """A proxy-only host of the inventory gets no stage part, so no line."""
    from vllm_fleet.commands.deploy import plan

    inv = _inventory(
        tmp_path,
        'servers = [("gpu1", {"ssh_hostname": "192.0.2.10"}), ("gpu2", {"ssh_hostname": "192.0.2.11"})]\n'
        'proxy = [("edge", {"ssh_hostname": "192.0.2.9"})]\n',
    )
    spec = _spec(tmp_path, server={"host": "0.0.0.0"})
    deployments, _ = plan(str(inv), str(spec))
    assert stagemod.staged_hosts(deployments) == ["gpu1", "gpu2"]
