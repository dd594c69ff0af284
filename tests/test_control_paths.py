"""Paths on the control machine that a spec names (held-out fuzzing round 3, class 1).

`install.wheelhouse` was probed with an unguarded ``Path(...).expanduser().is_dir()``: ``~user``
with no such user raised RuntimeError, a name over NAME_MAX or a path over PATH_MAX raised
OSError, in every command that loads the spec. Every value of spec.localpath.CONTROL_PATHS (and
each secret's file) now gives a problem with its YAML path, the path, why and the fix; the
readers at deploy time (secrets, the TLS certificate, the wheelhouse upload) say the same
without a traceback.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from fleetutil import run_cli
from vllm_fleet.specs import localpath, pipeline

REPO = Path(__file__).resolve().parents[1]
#: a CUDA example: validate looks inside its wheelhouse (the FlashInfer check)
CUDA = yaml.safe_load((REPO / "deployments" / "h200-qwen7b-bf16.yaml").read_text())


def _setters(tmp: Path) -> dict[str, object]:
    """{YAML path: how to put a value there} for every control-machine path of the spec."""

    def tls(d, v, key=False):
        d["proxy"]["tls"] = {
            "enabled": True,
            "certificate": str(tmp / "ok.crt"),
            "certificate_key": {"file": str(tmp / "ok.key")},
        }
        if key:
            d["proxy"]["tls"]["certificate_key"] = {"file": v}
        else:
            d["proxy"]["tls"]["certificate"] = v

    return {
        "model.source": lambda d, v: d["model"].update(source=v, transfer="upload"),
        "install.wheelhouse": lambda d, v: d["install"].update(wheelhouse=v),
        "proxy.tls.certificate": tls,
        "server.api_key.file": lambda d, v: d["server"].update(api_key={"file": v}),
        "model.hub_token.file": lambda d, v: d["model"].update(
            source="Qwen/Qwen2.5-7B-Instruct", transfer="hub", revision="a" * 40, hub_token={"file": v}
        ),
        "proxy.tls.certificate_key.file": lambda d, v: tls(d, v, key=True),
    }


def test_every_control_path_has_a_setter():
    """The one list and this test's table name the same YAML paths (a new path needs its case here)."""
    assert {cp.yaml_path for cp in localpath.control_paths()} == set(_setters(Path("/x")))


#: (case, value, severity, what the message says)
CASES = [
    ("unknown-user", "~vf-no-such-user-x/dir", "warning", "no user 'vf-no-such-user-x' on this machine"),
    ("name-max", "/tmp/" + "n" * 300, "error", "over NAME_MAX (255)"),
    ("path-max", "/" + "/".join(["p" * 200] * 25), "error", "over PATH_MAX (4096"),
    ("missing", "/nonexistent/vf-x", "warning", "it does not exist"),
    ("wrong-kind", None, "warning", "it is "),
]


@pytest.mark.parametrize("case,value,severity,says", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("yaml_path", sorted(_setters(Path("/x"))))
def test_an_unreadable_control_path_is_a_problem_at_its_yaml_path(tmp_path, yaml_path, case, value, severity, says):
    (tmp_path / "ok.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "ok.key").write_text("-----BEGIN PRIVATE KEY-----\n")
    if value is None:  # a file where a directory is wanted, or a directory where a file is
        kind = next(cp.kind for cp in localpath.control_paths() if cp.yaml_path == yaml_path)
        value = str(tmp_path / "ok.crt") if kind == "dir" else str(tmp_path)
    d = copy.deepcopy(CUDA)
    _setters(tmp_path)[yaml_path](d, value)
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(d))
    c = pipeline.check(str(spec))  # hardware checks on: the FlashInfer look into the wheelhouse runs
    mine = [p for p in c.problems if p.path == yaml_path and "cannot be read" in p.message]
    assert len(mine) == 1, [(p.path, p.message) for p in c.problems]
    p = mine[0]
    assert p.severity == severity and says in p.message and p.fix, p
    assert (value if len(value) < 80 else value[:40]) in p.message  # the path, as the user wrote it (cut when long)


@pytest.mark.parametrize(
    "value",
    ["~vf-no-such-user-x/wh", "/tmp/" + "n" * 300, "/" + "/".join(["p" * 200] * 25)],
    ids=["unknown-user", "name-max", "path-max"],
)
def test_validate_plan_render_with_an_unreadable_wheelhouse_give_no_traceback(tmp_path, value):
    """The reproducer's shape, through the CLI: every command that loads the spec."""
    d = copy.deepcopy(CUDA)
    d["install"]["wheelhouse"] = value
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(d))
    for cmd in (["validate"], ["plan"], ["render", "--out", str(tmp_path / "out")]):
        r = run_cli(*cmd, str(spec))
        assert "Traceback" not in r.stderr and r.returncode in (0, 1), (cmd, r.returncode, r.stderr[-2000:])
        assert "install.wheelhouse" in r.stdout + r.stderr, (cmd, r.stdout, r.stderr)


def test_a_generated_secret_may_be_missing_but_not_unnameable(tmp_path):
    d = copy.deepcopy(CUDA)
    d["server"]["api_key"] = {"file": str(tmp_path / "new.key"), "generate": True}
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(d))
    assert not [p for p in pipeline.check(str(spec)).problems if p.path == "server.api_key.file"]
    d["server"]["api_key"] = {"file": "~vf-no-such-user-x/k", "generate": True}
    spec.write_text(yaml.safe_dump(d))
    assert [p for p in pipeline.check(str(spec)).problems if p.path == "server.api_key.file"]


@pytest.mark.parametrize(
    "value",
    ["~vf-no-such-user-x/k", "/tmp/" + "n" * 300, "/" + "/".join(["p" * 200] * 25)],
    ids=["unknown-user", "name-max", "path-max"],
)
def test_the_deploys_readers_say_why_without_a_traceback(tmp_path, value):
    """What the deploy reads on the control machine: each secret, the TLS certificate, the
    wheelhouse (and host data vllm_find_links) it uploads."""
    from pyinfra.api.exceptions import DeployError

    from vllm_fleet.render.secrets import SecretError, read_secret
    from vllm_fleet.roles.common import _tls_certificate
    from vllm_fleet.roles.common.wheels import local_dir

    with pytest.raises(SecretError, match="server.api_key: .*cannot be read"):
        read_secret({"file": value}, yaml_path="server.api_key", base_dir=tmp_path)
    with pytest.raises(SecretError, match="server.api_key: .*cannot be read"):
        read_secret({"file": value, "generate": True}, yaml_path="server.api_key", base_dir=tmp_path, generated={})
    with pytest.raises(SecretError, match="proxy.tls.certificate: cannot read"):
        _tls_certificate({"proxy": {"tls": {"enabled": True, "certificate": value}}}, tmp_path)
    with pytest.raises(DeployError, match="install.wheelhouse: .*cannot be read on this machine"):
        local_dir(value, "install.wheelhouse")


def test_a_secret_that_is_a_directory_or_not_text_is_refused(tmp_path):
    from vllm_fleet.render.secrets import SecretError, read_secret

    with pytest.raises(SecretError, match="a directory"):
        read_secret({"file": str(tmp_path)}, yaml_path="server.api_key")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "bin").chmod(0o600)
    with pytest.raises(SecretError, match="not UTF-8"):
        read_secret({"file": str(tmp_path / "bin")}, yaml_path="server.api_key")
