"""Where the deploy takes its spec from, and what it reads on the control machine while it plans.

- the spec: data `vllm_fleet_spec` (--data, host, group), else $VLLM_FLEET_SPEC, else the lab's
  own for the lab inventory only; none: a message saying how; `spec=` (a typo) is an error;
- every secret of the spec (vllm_fleet.render.secrets.SPEC_SECRETS) is read; a `generate: true` key file
  that is missing is NOT written while planning (pyinfra --dry writes nothing here), only by the
  deploy's first operation when it executes;
- the TLS certificate and key from the control machine reach the host (the key was written empty).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from pyinfra.api import deploy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    from vllm_fleet.roles import common

    monkeypatch.setattr(common, "_CACHE", {})
    monkeypatch.setattr(common, "_GENERATED", {})
    monkeypatch.delenv("VLLM_FLEET_SPEC", raising=False)


def _spec(tmp_path: Path, **changes) -> Path:
    """deployments/lab-tiny.yaml with its key file and model directory under tmp_path."""
    data = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    (tmp_path / "model").mkdir(exist_ok=True)
    data["model"]["source"] = str(tmp_path / "model")
    data["server"]["api_key"] = {"file": str(tmp_path / "keys" / "api.key"), "generate": True}
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@deploy("plan only")
def _plan():
    from vllm_fleet.roles.common import load_deploy_spec, write_generated_secrets

    write_generated_secrets(load_deploy_spec())


@deploy("plan and nginx")
def _plan_nginx():
    from vllm_fleet.roles.common import load_deploy_spec, rendered_for_host
    from vllm_fleet.roles.nginx import install_nginx

    ctx = load_deploy_spec()
    install_nginx(
        spec=ctx.spec,
        where=ctx.layout.paths[ctx.first],
        rendered=rendered_for_host(ctx),
        api_key=ctx.secrets["api_key"],
        tls_key=ctx.secrets["tls_key"],
        tls_certificate=ctx.secrets["tls_certificate"],
    )


CLIENT: list = []


@deploy("plan and the client document")
def _plan_client():
    from vllm_fleet.roles.common import load_deploy_spec
    from vllm_fleet.roles.smoke import client_document
    from vllm_fleet.specs.load import load_and_check

    load_deploy_spec()
    CLIENT.append(client_document(load_and_check(CLIENT[0], hardware=False)[0]))


# -- where the spec comes from ------------------------------------------------------------------


def test_spec_source_order_and_messages():
    from vllm_fleet.specs.source import SpecSourceError, spec_source

    assert spec_source({"vllm_fleet_spec": "a.yaml"}, "h", env={"VLLM_FLEET_SPEC": "b.yaml"}) == (
        "a.yaml",
        "data vllm_fleet_spec",
    )
    assert spec_source({}, "h", env={"VLLM_FLEET_SPEC": "b.yaml"})[0] == "b.yaml"
    assert spec_source({"lab_kind": "nspawn"}, "lab1", env={})[0] == "deployments/lab-tiny.yaml"
    with pytest.raises(SpecSourceError) as e:
        spec_source({"ssh_hostname": "10.0.0.5"}, "gpu1", env={})
    msg = str(e.value)
    assert "gpu1" in msg and "--spec" in msg and "--data vllm_fleet_spec=" in msg and "VLLM_FLEET_SPEC" in msg
    with pytest.raises(SpecSourceError) as e:  # `--data spec=x.yaml`: not silently ignored, also with the env var set
        spec_source({"spec": "x.yaml"}, "gpu1", env={"VLLM_FLEET_SPEC": "b.yaml"})
    assert "`spec`" in str(e.value) and "--data vllm_fleet_spec=x.yaml" in str(e.value)


def test_a_real_host_without_a_spec_stops_before_any_operation(harness):
    from vllm_fleet.roles.common import DeployError

    with pytest.raises(DeployError, match="no deployment spec"):
        harness.run(_plan, host="gpu1", groups=["servers"], data={"ssh_hostname": "10.0.0.5"})


def test_host_data_names_the_spec_and_the_layout_has_only_its_hosts(harness, tmp_path):
    from vllm_fleet.roles.common import _CACHE

    spec = _spec(tmp_path)
    harness.run(
        _plan,
        host="gpu1",
        groups=["servers", "proxy"],
        data={"vllm_fleet_spec": str(spec), "private_address": "10.0.0.5", "ssh_hostname": "192.0.2.5"},
    )
    (ctx,) = _CACHE.values()
    assert ctx.path == str(spec) and set(ctx.rendered) == {"gpu1", "client"}


# -- secrets: planned in memory, written when the deploy executes --------------------------------


def test_planning_writes_no_key_file_and_the_first_operation_does(harness, tmp_path):
    from vllm_fleet.roles.common import _CACHE, _write_generated

    spec = _spec(tmp_path)
    key = tmp_path / "keys" / "api.key"
    run = harness.run(_plan, host="gpu1", groups=["servers"], data={"vllm_fleet_spec": str(spec)})
    assert not key.exists() and not key.parent.exists()  # what pyinfra --dry would leave: nothing
    assert len(run.ops) == 1 and run.op("Write generated secret files on the control machine").commands == [
        "python:_write_generated"
    ]
    (ctx,) = _CACHE.values()
    value = ctx.secrets["api_key"]
    assert value.startswith("sk-") and ctx.generated == {key: value}
    _write_generated(ctx.generated)  # what executing the operation does
    assert key.read_text() == value + "\n" and key.stat().st_mode & 0o777 == 0o600
    assert key.parent.stat().st_mode & 0o777 == 0o700


def test_an_existing_key_file_is_read_and_no_operation_is_added(harness, tmp_path):
    from vllm_fleet.roles.common import _CACHE

    spec = _spec(tmp_path)
    key = tmp_path / "keys" / "api.key"
    key.parent.mkdir()
    key.write_text("sk-existing\n")
    key.chmod(0o600)
    run = harness.run(_plan, host="gpu1", groups=["servers"], data={"vllm_fleet_spec": str(spec)})
    assert run.ops == []  # a converged deploy stays at zero changes
    assert next(iter(_CACHE.values())).secrets["api_key"] == "sk-existing"


def test_every_secret_of_the_spec_is_in_the_one_list():
    """Every `$ref: #/$defs/secret` in the schema is in SPEC_SECRETS (a new one cannot be missed)."""
    import json

    from vllm_fleet.render.secrets import SPEC_SECRETS
    from vllm_fleet.specs.load import SCHEMA_PATH

    found = []

    def walk(node, path):
        if isinstance(node, dict):
            if node.get("$ref") == "#/$defs/secret":
                found.append(".".join(path))
            for k, v in node.items():
                if k == "properties":
                    for name, sub in v.items():
                        walk(sub, [*path, name])
                elif k != "$defs":
                    walk(v, path)
        elif isinstance(node, list):
            for v in node:
                walk(v, path)

    walk(json.loads(SCHEMA_PATH.read_text()), [])
    assert sorted(found) == sorted(s.yaml_path for s in SPEC_SECRETS)


# -- TLS: certificate and key from the control machine -------------------------------------------

KEY_PEM = (
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\n-----END PRIVATE KEY-----\n"
)
CRT_PEM = "-----BEGIN CERTIFICATE-----\nMIIDazCCAlOgAwIBAgIUZ\n-----END CERTIFICATE-----\n"


def test_tls_certificate_and_key_reach_the_host(harness, tmp_path):
    (tmp_path / "tls.key").write_text(KEY_PEM)
    (tmp_path / "tls.key").chmod(0o600)
    (tmp_path / "tls.crt").write_text(CRT_PEM)
    spec = _spec(
        tmp_path,
        proxy={
            "listen": 443,
            "tls": {
                "enabled": True,
                "certificate": "tls.crt",  # relative to the spec
                "certificate_key": {"file": "tls.key"},
            },
        },
    )
    run = harness.run(_plan_nginx, host="gpu1", groups=["servers", "proxy"], data={"vllm_fleet_spec": str(spec)})
    assert run.uploads["/etc/nginx/vllm-fleet/lab-tiny.key"] == KEY_PEM
    assert run.uploads["/etc/nginx/vllm-fleet/lab-tiny.crt"] == CRT_PEM
    key_op = run.op("TLS private key")
    assert "install -m 600 /dev/null /etc/nginx/vllm-fleet/lab-tiny.key.tmp-vllm-fleet" in key_op.commands
    assert not any(KEY_PEM.splitlines()[1] in c for c in run.commands)  # the key is uploaded, never in a command


def test_a_tls_key_that_is_not_pem_stops_the_deploy(harness, tmp_path):
    from vllm_fleet.roles.common import DeployError

    (tmp_path / "tls.key").write_text("sk-not-a-key\n")
    (tmp_path / "tls.crt").write_text(CRT_PEM)
    spec = _spec(
        tmp_path,
        proxy={
            "listen": 443,
            "tls": {"enabled": True, "certificate": "tls.crt", "certificate_key": {"file": "tls.key"}},
        },
    )
    with pytest.raises(DeployError, match=r"proxy.tls.certificate_key: .*not a PEM file.*no host was changed"):
        harness.run(_plan_nginx, host="gpu1", groups=["servers", "proxy"], data={"vllm_fleet_spec": str(spec)})


def test_the_checkout_spec_dir_is_not_needed(tmp_path, monkeypatch):
    """A spec outside the checkout works from another directory (nothing is relative to the checkout)."""
    from vllm_fleet.specs.load import load_and_check

    spec = _spec(tmp_path)
    shutil.copy(spec, tmp_path / "copy.yaml")
    monkeypatch.chdir(tmp_path)
    resolved, _ = load_and_check("copy.yaml")
    assert resolved["name"] == "lab-tiny"


def test_the_smoke_role_takes_openai_json_from_the_deploys_layout(harness, tmp_path):
    """What the smoke role writes on the control machine is the deploy's rendered openai.json
    (vllm_fleet.render.files.client_settings through the one layout), the policy in effect included."""
    import json

    from vllm_fleet.render import layout as lay
    from vllm_fleet.specs.load import load_and_check

    spec = _spec(tmp_path)
    CLIENT[:] = [str(spec)]
    harness.run(_plan_client, host="gpu1", groups=["servers", "proxy"], data={"vllm_fleet_spec": str(spec)})
    resolved = load_and_check(spec, hardware=False)[0]
    want = lay.build(resolved, {"gpu1": {"address": "gpu1", "groups": ["servers", "proxy"], "data": {}}}).client
    assert CLIENT[1] == json.loads(want["~/.config/vllm-fleet/lab-tiny/openai.json"].content)
    assert CLIENT[1]["routing"]["policy"] == "least_conn" and CLIENT[1]["base_url"] == "http://gpu1/v1"
