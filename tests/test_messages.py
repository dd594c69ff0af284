"""Messages that misled a new user (issue 24, item 8), as they read now."""

from __future__ import annotations

from pathlib import Path

from vllm_fleet.commands.cli import main

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "deployments" / "lab-tiny.yaml"


def test_validate_with_an_inventory_that_fails_does_not_say_valid(tmp_path, capsys):
    inv = tmp_path / "inv.py"
    inv.write_text('servers = [("a", {"ssh_hostname": "192.0.2.1"})]\nproxy = [("b", {"ssh_hostname": "192.0.2.2"})]\n')
    rc = main(["validate", str(SPEC), "--inventory", str(inv)])
    out, err = capsys.readouterr()
    assert rc == 1
    assert f"{SPEC}: valid on its own (lab-tiny: tiny, cpu, TP 1 x PP 1), but not on {inv}: see below" in out
    assert f"{SPEC}: valid (" not in out
    # the proxy-reach fix names the deploy's own firewall, not a port for the user to open
    assert (
        "set server.host: 0.0.0.0 (the deploy's own nftables rules then let only the proxy hosts reach port 8000" in err
    )
    assert "firewall port" not in err


def test_an_accelerator_in_capitals_is_one_error_with_did_you_mean(tmp_path, capsys):
    bad = tmp_path / "cpu.yaml"
    bad.write_text(SPEC.read_text().replace("accelerator: cpu", "accelerator: CPU"))
    rc = main(["validate", str(bad)])
    err = capsys.readouterr().err
    assert rc == 1 and "install.accelerator" in err and "did you mean `cpu`?" in err
    assert "install.accelerator is cuda" not in err and "1 error(s)" in err
