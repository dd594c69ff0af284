"""The CUDA IPC probe of issue 39: the product's own vLLM unit, with its program swapped for
bench/gpu/ipc_test.py, run under systemd on the GPU machine (bench/gpu/ipc_probe.sh).

    python bench/gpu/ipc_probe.py render OUT LABEL [--ref GIT_REF] [--spec SPEC] [--python PY]
        renders SPEC (default the TP 2 proof spec) with the checkout, or with the vllm_fleet of
        GIT_REF (`git archive`: the unit as an earlier release rendered it), and writes OUT/LABEL/:
        the unit (every line as rendered but ExecStart=, which runs the IPC test, and the
        ExecStartPre= lines, which wait for things the test does not need), the env files the unit
        reads, and meta.json (unit name, user, state dir)
Then on the GPU machine: bash bench/gpu/ipc_probe.sh OUT (docs/gpu-proof.md).

Nothing here copies a line of the unit: the sandbox under test is what the template gives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "deployments" / "h200-qwen7b-bf16-tp2.yaml"
PYTHON = "/opt/torch/.venv/bin/python"  # the GPU machine's torch (docs/gpu-proof.md)


def rendered(spec: Path) -> dict:
    """{unit, files: {path: {content, mode}}, user, state_dir} from the vllm_fleet on sys.path."""
    from vllm_fleet.render import files as render
    from vllm_fleet.specs import load

    r = load.resolve(load.load(spec))
    out = {p: {"content": f.content, "mode": f.mode} for t in render.render(r).values() for p, f in t.items()}
    units = sorted(p for p in out if re.search(r"/vllm-[\w.-]+-\d+\.service$", p))
    return {
        "unit": units[0],
        "files": out,
        "user": r["server"]["user"],
        "state_dir": r["install"]["state_dir"],
        "name": r["name"],
    }


def probe_unit(text: str, python: str, script: str, result: str) -> str:
    """The rendered unit with its program replaced by the IPC test (and no ExecStartPre waits)."""
    lines = []
    for line in text.splitlines():
        if line.startswith("ExecStartPre=") and not line.startswith("ExecStartPre=-+"):
            continue
        if line.startswith("ExecStart="):
            line = f"ExecStart={python} {script} {result}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def render_cmd(a) -> int:
    a.out, a.spec = str(Path(a.out).resolve()), str(Path(a.spec).resolve())  # the --ref run works elsewhere
    if a.ref:  # the same function, run against the vllm_fleet of an earlier commit
        with tempfile.TemporaryDirectory() as tmp:
            arch = subprocess.run(
                ["git", "-C", str(ROOT), "archive", a.ref, "vllm_fleet"], capture_output=True, check=True
            ).stdout
            with tarfile.open(fileobj=__import__("io").BytesIO(arch)) as tf:
                tf.extractall(tmp)
            env = {**os.environ, "VLLM_FLEET_PROBE_TREE": tmp}
            return subprocess.run(
                [sys.executable, __file__, "render", a.out, a.label, "--spec", a.spec, "--python", a.python],
                env=env,
                cwd=tmp,
            ).returncode
    sys.path.insert(
        0, os.environ.get("VLLM_FLEET_PROBE_TREE") or str(ROOT)
    )  # that tree's vllm_fleet, not an installed one
    import vllm_fleet

    r = rendered(Path(a.spec))
    d = Path(a.out) / a.label
    d.mkdir(parents=True, exist_ok=True)
    probe = f"{r['state_dir']}/ipc-probe"
    unit = probe_unit(r["files"][r["unit"]]["content"], a.python, f"{probe}/ipc_test.py", f"{probe}/result.json")
    (d / "unit").write_text(unit)
    env = {p: f for p, f in r["files"].items() if p.endswith(".env")}
    (d / "meta.json").write_text(
        json.dumps(
            {
                "label": a.label,
                "ref": a.ref or "checkout",
                "rendered_by": str(Path(vllm_fleet.__file__).parent),
                "spec": Path(a.spec).name,
                "unit": Path(r["unit"]).name,
                "user": r["user"],
                "state_dir": r["state_dir"],
                "probe_dir": probe,
                "env_files": env,
                "syscall_lines": [l for l in unit.splitlines() if l.startswith("SystemCall")],
            },
            indent=1,
        )
    )
    print(
        f"{d}: {Path(r['unit']).name} ({', '.join(l for l in unit.splitlines() if l.startswith('SystemCallFilter'))})"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("out")
    r.add_argument("label")
    r.add_argument("--ref")
    r.add_argument("--spec", default=str(SPEC))
    r.add_argument("--python", default=PYTHON)
    return render_cmd(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
