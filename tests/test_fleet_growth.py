"""What grows with the fleet (issue 36, item 5): many servers and no `proxy` group earn a warning
with the fix, naming the spec; with a proxy group what is rendered grows linearly; the deploy
reads each host's spec data once per run, not once per host per host."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_fleet.render.layout import build, render_entry
from vllm_fleet.render.parts import MANY_PROXIES
from vllm_fleet.specs.load import load_and_check

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "deployments" / "lab-tiny-replicas.yaml"


@pytest.fixture(scope="module")
def resolved():
    return load_and_check(str(SPEC))[0]


def _inventory(n: int, proxies: int = 0) -> dict:
    return {
        f"gpu{i}": render_entry(
            f"gpu{i}",
            ["servers"] + (["proxy"] if i < proxies else []),
            {"ssh_hostname": f"10.20.{i // 250}.{i % 250 + 1}"},
        )
        for i in range(n)
    }


def _bytes(layout) -> int:
    return sum(len(f.content.encode()) for h, fs in layout.files().items() if h != "client" for f in fs.values())


def test_many_servers_without_a_proxy_group_warn_with_the_fix_naming_the_spec(resolved):
    lay = build([resolved], _inventory(MANY_PROXIES), sources={resolved["name"]: str(SPEC)})
    assert len(lay.hosts_with("proxy", resolved["name"])) == MANY_PROXIES  # nginx on every server host
    (w,) = lay.warnings
    assert w.startswith(f"{SPEC}: proxy: no host of the inventory is in the `proxy` group")
    assert (
        f"each of the {MANY_PROXIES} server hosts of lab-tiny-replicas" in w
        and "Fix: put one or two hosts in the inventory's `proxy` group" in w
    )
    assert not build([resolved], _inventory(MANY_PROXIES - 1)).warnings
    assert not build([resolved], _inventory(4 * MANY_PROXIES, proxies=1)).warnings


@pytest.mark.parametrize("command", ["deploy", "stage", "down"])
def test_vllm_fleet_deploy_and_stage_print_the_warning_before_pyinfra_and_down_does_not(
    tmp_path, capsys, monkeypatch, command
):
    from test_fleet_commands import _spec
    from vllm_fleet.commands import deploy as deploycmd
    from vllm_fleet.commands import down as downcmd
    from vllm_fleet.commands import stage as stagecmd
    from vllm_fleet.commands.cli import build_parser

    spec = _spec(tmp_path, server={"host": "0.0.0.0"})
    inv = tmp_path / "inv.py"
    inv.write_text(
        "servers = " + repr([(f"gpu{i}", {"ssh_hostname": f"10.20.0.{i + 1}"}) for i in range(MANY_PROXIES)]) + "\n"
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args([command, str(inv), "--spec", str(spec), "--dry"])
    run = {"deploy": deploycmd.cmd_deploy, "stage": stagecmd.cmd_stage, "down": downcmd.cmd_down}[command]
    assert run(args, runner=lambda argv: 0) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    said = f"vllm-fleet {command}: {spec}: proxy: no host of the inventory is in the `proxy` group" in err
    assert said == (command != "down"), err


def test_with_a_proxy_group_what_is_rendered_grows_linearly(resolved):
    small, big = (_bytes(build([resolved], _inventory(n, proxies=1))) for n in (32, 128))
    assert big < 4.5 * small, (small, big)  # 4x the hosts: about 4x the bytes
    small, big = (_bytes(build([resolved], _inventory(n))) for n in (32, 128))
    assert big > 5 * small, (small, big)  # without: every host's nginx lists every replica


def test_the_deploy_reads_each_hosts_spec_data_once_per_run(monkeypatch):
    from pyinfra.api import Config, Inventory, State
    from pyinfra.context import ctx_host, ctx_inventory, ctx_state

    import vllm_fleet.roles.common as common

    calls: list[str] = []
    real = common.spec_paths

    def counted(h=None):
        calls.append(getattr(h, "name", "self"))
        return real(h)

    monkeypatch.setattr(common, "spec_paths", counted)
    n = 40
    hosts = [
        (f"gpu{i}", {"vllm_fleet_spec": str(SPEC) if i % 2 else str(REPO / "deployments" / "lab-tiny.yaml")})
        for i in range(n)
    ]
    inv = Inventory((hosts, {}))
    firsts = []
    with ctx_inventory.use(inv), ctx_state.use(State(inv, Config())):
        for h in inv:
            with ctx_host.use(h):
                order, per_host = common.fleet_spec_paths()
                firsts.append(order[0])
    assert len(calls) <= 2 * n, len(calls)  # each host's own, plus every host once: not n * n
    assert firsts[:2] == [str(REPO / "deployments" / "lab-tiny.yaml"), str(SPEC)]  # each host's own spec first
    assert sorted(order) == sorted([str(SPEC), str(REPO / "deployments" / "lab-tiny.yaml")]) and len(per_host) == n
