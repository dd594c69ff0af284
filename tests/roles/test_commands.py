"""Every command line a role sends is built through vllm_fleet.host.programs (each value a pyinfra
``QuoteString``), never with a bare ``StringCommand(...)`` whose plain strings go to the shell
unquoted (``StringCommand("mv", "-f", tmp, path)`` runs whatever ``path`` says)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import vllm_fleet.roles
from vllm_fleet.host.programs import argv, chain, group, quiet, text, to_file, to_stderr, with_stderr

ROLES = Path(vllm_fleet.roles.__file__).parent
BUILDERS = {"StringCommand", "QuoteString"}


def bare_builders(source: str) -> list[int]:
    """The lines of ``source`` that call StringCommand or QuoteString themselves (by name or as an
    attribute, e.g. ``api.StringCommand(...)``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in BUILDERS:
                lines.append(node.lineno)
    return lines


def test_no_role_builds_a_command_line_by_hand():
    found = {f"{p.relative_to(ROLES)}:{n}" for p in ROLES.rglob("*.py") for n in bare_builders(p.read_text())}
    assert not found, (
        f"build these through vllm_fleet.host.programs (argv, chain, group, to_file, quiet...): {sorted(found)}"
    )


def test_the_check_sees_a_bare_builder_added_back():
    assert bare_builders('from pyinfra.api import StringCommand\nx = StringCommand("mv", "-f", tmp, path)\n') == [2]
    assert bare_builders("import pyinfra.api as a\n\n\nx = a.QuoteString(p)\n") == [4]
    assert bare_builders("def f() -> list[StringCommand]:\n    return [argv('mv', a, b)]\n") == []


def test_the_helpers_quote_every_value_and_run_as_the_shell_reads_them(tmp_path):
    """What the roles now send, run by sh: a path with a space and a ``;`` stays one argument."""
    odd = tmp_path / "a b; touch pwned"
    line = chain(
        quiet(argv("test", "-e", odd)),
        group(to_file(argv("printf", "%s\\n", "v 1"), odd), to_stderr(argv("echo", "made"))),
        op="||",
    )
    r = subprocess.run(["sh", "-c", text(line)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "made\n" and odd.read_text() == "v 1\n"
    assert not (tmp_path / "pwned").exists()
    # the second time the file is there: nothing is said, nothing is written
    r = subprocess.run(["sh", "-c", text(line)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == ""
    r = subprocess.run(["sh", "-c", text(with_stderr(argv("ls", tmp_path / "none")))], capture_output=True, text=True)
    assert r.returncode != 0 and "none" in r.stdout and r.stderr == ""
    assert text(quiet(argv("x"), out=False)) == "x 2>/dev/null" and text(quiet(argv("x"), err=False)) == "x >/dev/null"
