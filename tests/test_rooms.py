"""Who may import whom (shared/DESIGN.md), read from the code's own import statements, those inside
functions too: specs/ (loading, checks, planner, catalogues) imports nothing of vllm_fleet outside
specs/, and host/ (how a host is reached) nothing outside host/; its scripts/ run on hosts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vllm_fleet

PACKAGE = Path(vllm_fleet.__file__).parent


def imports_out_of(room: str, source: str) -> list[str]:
    """The vllm_fleet modules ``source`` imports that are not under ``vllm_fleet.ROOM``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else []
        )
        if isinstance(node, ast.ImportFrom) and node.module == "vllm_fleet":
            names = [f"vllm_fleet.{a.name}" for a in node.names]
        out += [
            f"{n} (line {node.lineno})"
            for n in names
            if n.split(".")[0] == "vllm_fleet" and n != f"vllm_fleet.{room}" and not n.startswith(f"vllm_fleet.{room}.")
        ]
    return out


@pytest.mark.parametrize("room", ["specs", "host"])
def test_a_room_imports_nothing_of_the_rooms_above_it(room):
    found = {
        f"{p.relative_to(PACKAGE)}: {m}"
        for p in (PACKAGE / room).rglob("*.py")
        if "scripts" not in p.relative_to(PACKAGE / room).parts
        for m in imports_out_of(room, p.read_text())
    }
    assert not found, sorted(found)


def test_the_check_sees_an_import_inside_a_function():
    src = (
        "def f():\n    from vllm_fleet.fetch import flashinfer\n    from vllm_fleet import render\n"
        "    from vllm_fleet.specs import load\n"
    )
    assert imports_out_of("specs", src) == ["vllm_fleet.fetch (line 2)", "vllm_fleet.render (line 3)"]
