"""vllm_fleet.host.programs: the command lines as the host's shell runs them."""

from __future__ import annotations

import subprocess

from vllm_fleet.host.programs import argv, chain, if_then, text


def test_if_then_runs_its_commands_only_when_the_condition_holds_and_succeeds_either_way(tmp_path):
    """``if_then`` (the firewall's nft table on removal, the router's unit removal): quoted arguments, the
    commands in order, status 0 when the condition fails (``&&`` would fail the operation)."""
    there, out = tmp_path / "a file", tmp_path / "out"
    line = if_then(argv("test", "-e", there), chain(argv("false"), "true", op="||"), argv("touch", out))
    assert text(line) == f"if test -e '{there}' ; then false || true ; touch {out} ; fi"
    assert subprocess.run(["sh", "-c", text(line)]).returncode == 0 and not out.exists()
    there.write_text("")
    assert subprocess.run(["sh", "-c", text(line)]).returncode == 0 and out.exists()
