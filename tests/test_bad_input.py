"""Bad input: every invalid spec is refused with its YAML path (and line), a fix, exit 1 and
no traceback; a deploy with one stops before any operation.

The committed corpus is tests/specs/invalid/*.yaml (each with `# expect:` lines, also run by
tests/test_spec.py). Inputs that cannot sensibly be committed (an empty file, a huge one,
non-UTF-8 bytes, a YAML alias bomb, a directory) are generated into tmp here. Every check reads
what a user reads: the CLI's stderr and pyinfra's output, from separate processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleetutil import REPO, run_cli

INVALID = sorted((REPO / "tests" / "specs" / "invalid").glob("*.yaml"))
PYINFRA = str(Path(sys.executable).parent / "pyinfra")
# "<file>: error: <path>[ (line N)]: <message>" and on the next line "    fix: <fix>"
ERROR_LINE = re.compile(r"^(?P<file>.+?): error: (?P<path>.+?)(?: \(line (?P<line>\d+)\))?: (?P<msg>.+)$")


def errors(stderr: str) -> list[dict]:
    """The error problems the CLI printed, each with the fix printed under it."""
    out, lines = [], stderr.splitlines()
    for i, line in enumerate(lines):
        m = ERROR_LINE.match(line)
        if m:
            fix = lines[i + 1].strip() if i + 1 < len(lines) else ""
            out.append({**m.groupdict(), "fix": fix[len("fix:") :].strip() if fix.startswith("fix:") else ""})
    return out


def _key_in_text(path: str, text: str) -> bool:
    """Whether the last key of a dotted YAML path is written in the spec (then YAML has a line)."""
    last = re.sub(r"\[\d+\]$", "", path).rpartition(".")[2]
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return bool(re.search(rf"(^|[\s{{,]){re.escape(last)}\s*:", body, re.M))


def test_corpus_has_at_least_40_cases():
    assert len(INVALID) >= 40, len(INVALID)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_each_error_has_path_line_and_fix(path):
    r = run_cli("validate", str(path))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errs = errors(r.stderr)
    assert errs, r.stderr
    text = path.read_text(encoding="utf-8")
    for e in errs:
        assert e["fix"], f"no fix for {e}"
        if e["path"] == "(top level)":
            # only whole-file problems sit at the top level; a YAML syntax error has a line
            if "YAML" in e["msg"]:
                assert e["line"], e
        else:
            assert re.fullmatch(r"[A-Za-z_][\w-]*(\.[\w-]+|\[\d+\])*", e["path"]), e
            if _key_in_text(e["path"], text):
                assert e["line"], f"{e['path']} is written in the file but no line is given: {e}"
    assert "nothing was changed" in r.stderr


GENERATED = {
    # name: (bytes, text that stderr must contain)
    "empty": (b"", "empty"),
    "whitespace-only": (b"\n\n   \n", "empty"),
    "comments-only": (b"# just a comment\n", "no content"),
    "huge": (b"name: x\n# " + b"a" * (2 * 1024 * 1024) + b"\n", "at most"),
    "latin-1": ("name: x\nmodel: {source: caf\u00e9/m}\n".encode("latin-1"), "not UTF-8"),
    "utf-16": ("name: x\nmodel: {source: a/b}\n".encode("utf-16"), "not UTF-8"),
    "gzip-bytes": (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + bytes(range(256)), "not UTF-8"),
    "scalar-document": (b"just a string\n", "must be a mapping"),
    "two-documents": (b"name: x\n---\nname: y\n", "YAML"),
}


GENERATED["nul-bytes"] = (b"name: x\x00\nmodel: {source: a/b}\n", "YAML")
GENERATED["bell-character"] = (b"name: x\x07\nmodel: {source: a/b}\n", "YAML")


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_generated_bad_files(tmp_path, name):
    data, text = GENERATED[name]
    f = tmp_path / f"{name}.yaml"
    f.write_bytes(data)
    r = run_cli("validate", str(f))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and text in r.stderr and "fix:" in r.stderr, r.stderr


def test_a_directory_is_not_a_spec(tmp_path):
    r = run_cli("validate", str(tmp_path))
    assert r.returncode == 1 and "is a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_python_tags_are_not_executed(tmp_path):
    """yaml.SafeLoader semantics: a !!python tag never runs code."""
    marker = tmp_path / "pwned"
    f = tmp_path / "s.yaml"
    f.write_text(f'name: x\nmodel: !!python/object/apply:os.system ["touch {marker}"]\n')
    r = run_cli("validate", str(f))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\n")
    try:
        r = subprocess.run(
            [sys.executable, "-m", "vllm_fleet", "validate", str(f)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("validate still running after 15 s on a 1.6 kB alias bomb")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "fix:" in r.stderr, r.stderr


# -- a deploy with a bad spec: pyinfra stops while loading deploys/serve.py, before any operation

LOCAL_INVENTORY = 'servers = ["@local"]\nproxy = ["@local"]\n'
DEPLOY_CASES = [
    "yaml-syntax",
    "missing-source",
    "typo-served-name",
    "parallel-product-mismatch",
    "api-key-in-extra-args",
    "same-port-proxy-and-server",
]


def pyinfra_deploy(
    inventory: Path, spec: Path | str, *extra: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "VLLM_FLEET_SPEC": str(spec)}
    return subprocess.run(
        [PYINFRA, "-y", *extra, str(inventory), "deploys/serve.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("case", DEPLOY_CASES)
def test_pyinfra_with_a_bad_spec_starts_no_operation(tmp_path, case):
    """`--dry` is only a safety net (the inventory is this machine): the spec must be refused
    while deploys/serve.py loads, with the same path and fix the CLI prints."""
    inv = tmp_path / "inventory.py"
    inv.write_text(LOCAL_INVENTORY)
    spec = REPO / "tests" / "specs" / "invalid" / f"{case}.yaml"
    r = pyinfra_deploy(inv, spec, "--dry")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "the spec has errors; no host was changed" in out, out[-3000:]
    assert "Traceback" not in out and "Starting operation" not in out and "Proposed changes" not in out
    cli = errors(run_cli("validate", str(spec)).stderr)
    for e in cli:
        assert e["path"] in out and e["fix"] in out, (e, out[-3000:])


def test_inventory_without_a_server_group_is_a_message_not_a_traceback(tmp_path):
    """Found by this file: render's RenderError escaped load_deploy_spec as a traceback."""
    inv = tmp_path / "inventory.py"
    inv.write_text('somewhere = ["@local"]\n')
    spec = tmp_path / "ok.yaml"
    spec.write_text(
        "name: ctl\nmodel: {source: /srv/models/x, transfer: none, max_model_len: 512}\n"
        "server: {api_key: {env: H7_TEST_KEY}}\ninstall: {accelerator: cpu}\nhardware: {gpu: cpu}\n"
    )
    r = pyinfra_deploy(inv, spec, "--dry", env={"H7_TEST_KEY": "not-a-real-key"})
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "Traceback" not in out, out[-3000:]
    assert "put a host in the `servers` group" in out and "no host was changed" in out, out[-3000:]


# -- issue 12: inputs that blocked, exhausted memory or crashed; the command line's own mistakes


def _timed_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "vllm_fleet", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm-fleet {' '.join(args)} still running after {timeout} s")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    r = _timed_cli(["validate", str(fifo)], 15)
    assert r.returncode == 1 and "not a regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_without_reading_it(device):
    r = _timed_cli(["validate", device], 15)
    assert r.returncode == 1 and "not a regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_big_flow_map_is_refused_fast_and_small(tmp_path):
    """Under the size limit, a flow map of 18,000 entries: refused by the node budget after its
    first values (was 30 s and 555 MB at 1 MB). Time and peak memory of `vllm-fleet validate`
    alone: a fresh Python runs it and reads getrusage of its one child (this process's own
    RUSAGE_CHILDREN is the largest child it ever waited for, e.g. a deploy earlier in the run)."""
    f = tmp_path / "flow.yaml"
    f.write_text("{" + ",".join(f"k{i}: {i}" for i in range(18000)) + "}\n")
    assert f.stat().st_size < 256 * 1024
    probe = (
        "import json, resource, subprocess, sys, time\n"
        "t0 = time.monotonic()\n"
        "r = subprocess.run([sys.executable, '-m', 'vllm_fleet', 'validate', sys.argv[1]], capture_output=True, "
        "text=True,\n"
        "                   timeout=15, stdin=subprocess.DEVNULL)\n"
        "print(json.dumps({'rc': r.returncode, 'stderr': r.stderr, 'took': time.monotonic() - t0,\n"
        "                  'peak_mib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(f)], cwd=REPO, capture_output=True, text=True, timeout=60)
    res = json.loads(out.stdout)
    assert res["rc"] == 1 and "more than 10000 values" in res["stderr"] and "Traceback" not in res["stderr"], res[
        "stderr"
    ]
    assert res["took"] < 5 and res["peak_mib"] < 200, (res["took"], res["peak_mib"])


def test_render_out_mistakes_are_messages(tmp_path):
    spec = str(REPO / "deployments" / "lab-tiny.yaml")
    a_file = tmp_path / "f"
    a_file.write_text("x")
    cases = {
        "": "--out is empty",
        str(a_file): "not a directory",
        "/proc/vllm-fleet-render": "cannot write",
        str(a_file / "sub"): "cannot write",
    }
    for out, text in cases.items():
        r = run_cli("render", spec, "--out", out, cwd=tmp_path)
        assert r.returncode == 1 and text in r.stderr and "Traceback" not in r.stderr, (out, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # "" did not render into the cwd


def test_plan_with_an_unknown_gpu_is_a_usage_error():
    r = run_cli("plan", str(REPO / "deployments" / "lab-tiny.yaml"), "--gpu", "no-such-gpu")
    assert r.returncode == 2 and "h200" in r.stderr and "rtx3090" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_broken_pipe_is_not_success():
    """`validate SPEC | head -1` exited 0 when the pipe closed: the BrokenPipeError was turned
    into success. Here stdout is a pipe whose reader is gone before the `valid` line."""
    rd, wr = os.pipe()
    os.close(rd)
    p = subprocess.run(
        [sys.executable, "-m", "vllm_fleet", "validate", str(REPO / "deployments" / "lab-tiny.yaml")],
        cwd=REPO,
        stdout=wr,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    os.close(wr)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
