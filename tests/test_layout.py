"""The per-host layout (vllm_fleet.render.layout) and the checks over several specs and an inventory.

What a user would check: which units, ports, GPUs and cores each host gets (read back from the
rendered unit and env files with a shell), what nginx balances over, and that `vllm-fleet
validate` / `render` refuse a fleet whose deployments collide, naming hosts, specs and the fix.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fleet.render import layout as lay

from vllm_fleet.render import files as render

from vllm_fleet.specs import load as spec

REPO = Path(__file__).resolve().parent.parent


def resolved_of(name: str) -> dict:
    return spec.resolve(spec.load(REPO / "deployments" / f"{name}.yaml"))


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_fleet", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def env_of(text: str) -> dict[str, str]:
    """KEY=value lines as systemd's EnvironmentFile= reads them (test_render reads quoting back with a shell)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v[1:-1] if v[:1] == v[-1:] == "'" and len(v) > 1 else v
    return out


def gpu_spec(name: str = "q", tp: int = 2, per_host: int = 4, gpus: int = 8, gpu_ids=None, port: int = 8000) -> dict:
    raw = {
        "name": name,
        "model": {"source": "/srv/m", "transfer": "none", "max_model_len": 4096},
        "parallel": {"tensor": tp},
        "replicas": {"per_host": per_host},
        "server": {"port": port, "api_key": {"env": "K"}},
        "install": {"accelerator": "cuda"},
        "hardware": {"gpu": "h100-80gb", "gpus_per_node": gpus},
    }
    if gpu_ids is not None:
        raw["hardware"]["gpu_ids"] = gpu_ids
    s = spec.Spec(raw=raw)
    assert not spec.schema_problems(s), spec.schema_problems(s)
    return spec.resolve(s)


def host(address: str, groups: list[str], **data) -> dict:
    return {"address": address, "groups": groups, "data": data}


# ---------------------------------------------------------------------------------------------
# Replicas on one host


def test_four_tp2_replicas_split_eight_gpus():
    inv = {"gpu1": host("10.0.0.1", ["servers", "proxy"])}
    out = render.render(gpu_spec(), inv)["gpu1"]
    units = sorted(p for p in out if p.startswith("/etc/systemd/system/vllm-q-"))
    assert units == [f"/etc/systemd/system/vllm-q-{i}.service" for i in range(4)]
    seen = []
    for i in range(4):
        env = env_of(out[f"/etc/vllm-fleet/q/replica-{i}.env"].content)
        assert env["CUDA_VISIBLE_DEVICES"] == f"{2 * i},{2 * i + 1}"
        assert env["TMPDIR"] == f"/var/lib/vllm-fleet/q/replica-{i}/tmp"
        seen += env["CUDA_VISIBLE_DEVICES"].split(",")
        unit = out[f"/etc/systemd/system/vllm-q-{i}.service"].content
        assert f"--port {8000 + i}" in unit and "--tensor-parallel-size 2" in unit
        assert f"EnvironmentFile=/etc/vllm-fleet/q/replica-{i}.env" in unit.splitlines()
        assert f"WorkingDirectory=/var/lib/vllm-fleet/q/replica-{i}" in unit.splitlines()
    assert sorted(seen, key=int) == [str(g) for g in range(8)]  # every GPU once
    site = out["/etc/nginx/conf.d/vllm-fleet-q.conf"].content
    for i in range(4):
        assert f"server 127.0.0.1:{8000 + i} max_fails=2 fail_timeout=10s;" in site


def test_upstream_lists_every_instance_on_every_host():
    r = resolved_of("lab-tiny-replicas")
    inv = {
        "lab1": host("10.10.0.11", ["servers", "proxy"], replicas_per_host=2),
        "lab2": host("mgmt-lab2", ["servers"], private_address="10.10.0.12"),
    }
    out = render.render(r, inv)
    site = out["lab1"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"].content
    ups = [line.strip() for line in site.splitlines() if line.strip().startswith("server ") and ":" in line]
    assert ups == [
        "server 127.0.0.1:8000 max_fails=2 fail_timeout=10s;",
        "server 127.0.0.1:8001 max_fails=2 fail_timeout=10s;",
        "server 10.10.0.12:8000 max_fails=2 fail_timeout=10s;",
    ]  # lab2 at its private address, not ssh's
    assert "/etc/systemd/system/vllm-lab-tiny-replicas-1.service" in out["lab1"]
    assert "/etc/systemd/system/vllm-lab-tiny-replicas-1.service" not in out["lab2"]
    # lab2's API port is open to the proxy's private address only
    assert "elements = { 10.10.0.11 }" in out["lab2"]["/etc/vllm-fleet/api-firewall.nft"].content
    # a rollout batch of instances: only lab1:1 out of the upstream
    site = render.render_many([r], inv, down=["lab1:1"])["lab1"][
        "/etc/nginx/conf.d/vllm-fleet-lab-tiny-replicas.conf"
    ].content
    assert "server 127.0.0.1:8001 max_fails=2 fail_timeout=10s down;" in site
    assert "server 127.0.0.1:8000 max_fails=2 fail_timeout=10s;" in site


def test_cpu_replicas_get_their_own_cores():
    r = resolved_of("lab-tiny-replicas")
    r["env"] = {}
    out = render.render(r, {"lab1": host("10.10.0.11", ["servers", "proxy"], replicas_per_host=2, cpu_count=8)})["lab1"]
    binds = [
        env_of(out[f"/etc/vllm-fleet/lab-tiny-replicas/replica-{i}.env"].content)["VLLM_CPU_OMP_THREADS_BIND"]
        for i in (0, 1)
    ]
    assert binds == ["0-3", "4-7"]
    r["parallel"]["tensor"] = 2  # two ranks each: their own ranges inside the replica's block
    out = render.render(r, {"lab1": host("10.10.0.11", ["servers", "proxy"], replicas_per_host=2, cpu_count=8)})["lab1"]
    binds = [
        env_of(out[f"/etc/vllm-fleet/lab-tiny-replicas/replica-{i}.env"].content)["VLLM_CPU_OMP_THREADS_BIND"]
        for i in (0, 1)
    ]
    assert binds == ["0-1|2-3", "4-5|6-7"]
    # one replica of one rank: vLLM's own binding (nothing to share)
    single = render.render(resolved_of("lab-tiny"), {"lab1": host("10.10.0.11", ["servers", "proxy"])})["lab1"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in single["/etc/vllm-fleet/lab-tiny/replica-0.env"].content


def test_layout_parts_files_and_secrets_by_name():
    r = resolved_of("lab-tiny-replicas")
    inv = {
        "lab1": host("10.10.0.11", ["servers", "proxy"]),
        "lab2": host("10.10.0.12", ["servers"]),
        "other": host("10.10.0.13", ["ray_head"]),
    }
    layout = lay.build([r], inv)
    assert sorted(layout.hosts) == ["lab1", "lab2"]  # `ray_head` means nothing: left alone
    assert layout.hosts["lab1"].roles() == {"server", "proxy"} and layout.hosts["lab2"].roles() == {"server"}
    assert [i.id for i in layout.instances()] == ["lab1:0", "lab2:0"]
    assert {(s.deployment, s.key) for s in layout.hosts["lab1"].secrets} == {("lab-tiny-replicas", "api_key")}
    assert set(layout.hosts["lab1"].secrets[0].paths) | set(layout.hosts["lab1"].secrets[1].paths) == {
        "/etc/vllm-fleet/lab-tiny-replicas/secrets.env",
        "/etc/nginx/vllm-fleet/lab-tiny-replicas-auth.conf",
    }
    # render is the files view of the same layout
    assert render.render(r, copy.deepcopy(inv)) == layout.files()


def test_multinode_uses_the_private_address_and_ssh_may_differ():
    r = resolved_of("2node-ray-pp2")
    inv = {
        "gpu-a": host("mgmt-a.example", ["servers"], private_address="10.10.0.11"),
        "gpu-b": host("mgmt-b.example", ["workers"], private_address="10.10.0.12"),
        "edge": host("10.10.0.5", ["proxy"]),
    }
    out = render.render(r, inv)
    assert env_of(out["gpu-a"]["/etc/vllm-fleet/llama70b-2node/node.env"].content)["VLLM_HOST_IP"] == "10.10.0.11"
    assert env_of(out["gpu-b"]["/etc/vllm-fleet/llama70b-2node/node.env"].content)["NODE_IP"] == "10.10.0.12"
    assert "elements = { 10.10.0.11, 10.10.0.12 }" in out["gpu-b"]["/etc/vllm-fleet/ray-firewall.nft"].content
    assert "server 10.10.0.11:8000" in out["edge"]["/etc/nginx/conf.d/vllm-fleet-llama70b-2node.conf"].content
    inv["gpu-a"]["data"]["private_address"] = "10.10.0.99"
    with pytest.raises(
        render.RenderError, match="head_address is 10.10.0.11 but the head host gpu-a has private address 10.10.0.99"
    ):
        render.render(r, inv)


# ---------------------------------------------------------------------------------------------
# Several deployments on one host


def test_two_deployments_share_a_host_on_their_own_gpus_ports_and_sites():
    a = gpu_spec("chat", tp=2, per_host=2, gpus=4, gpu_ids=[0, 1, 2, 3])
    b = gpu_spec("code", tp=4, per_host=1, gpus=4, gpu_ids=[4, 5, 6, 7], port=9000)
    b["proxy"]["listen"] = 8080
    inv = {"gpu1": host("10.0.0.1", ["servers", "proxy"])}
    out = render.render_many([a, b], inv)["gpu1"]
    assert env_of(out["/etc/vllm-fleet/chat/replica-1.env"].content)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env_of(out["/etc/vllm-fleet/code/replica-0.env"].content)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert {"/etc/nginx/conf.d/vllm-fleet-chat.conf", "/etc/nginx/conf.d/vllm-fleet-code.conf"} <= set(out)
    assert "listen 8080" in out["/etc/nginx/conf.d/vllm-fleet-code.conf"].content
    assert "server 127.0.0.1:9000" in out["/etc/nginx/conf.d/vllm-fleet-code.conf"].content
    assert "server 127.0.0.1:800" not in out["/etc/nginx/conf.d/vllm-fleet-code.conf"].content


def _problems(specs, inv) -> str:
    with pytest.raises(lay.LayoutError) as exc:
        lay.build(specs, inv, sources={s["name"]: f"{s['name']}.yaml" for s in specs})
    return str(exc.value)


def test_collisions_name_the_host_the_specs_and_the_fix():
    inv = {"gpu1": host("10.0.0.1", ["servers", "proxy"])}
    text = _problems([gpu_spec("chat", per_host=2, gpus=4), gpu_spec("code", per_host=2, gpus=4)], inv)
    assert (
        "gpu1: GPUs 0, 1 are over-subscribed: vllm-chat-0.service 0.9 + vllm-code-0.service 0.9 = 1.8 of its memory"
        in text
        and "chat (chat.yaml), code (code.yaml)" in text
    )
    assert "hardware.gpu_ids" in text
    assert "gpu1: port 8000 is used by vLLM vllm-chat-0.service and by vLLM vllm-code-0.service (code.yaml)" in text
    assert "both serve nginx port 80 with server_name _: give each its own proxy.listen or proxy.server_name" in text


def test_replicas_that_do_not_fit():
    text = _problems([gpu_spec("big", tp=4, per_host=3, gpus=8)], {"gpu1": host("10.0.0.1", ["servers", "proxy"])})
    assert (
        "gpu1: big.yaml: 3 replica(s) x 4 GPU(s)" in text
        and "need 12 GPUs" in text
        and "lower replicas.per_host to 2" in text
    )
    text = _problems(
        [gpu_spec("ids", tp=2, per_host=1, gpus=4, gpu_ids=[0, 1])], {"gpu1": host("10.0.0.1", ["servers"])}
    )
    assert "hardware.gpu_ids lists 2 GPU(s) but hardware.gpus_per_node is 4" in text


def test_a_host_listed_twice():
    inv = {"a": host("10.0.0.1", ["servers", "proxy"]), "b": host("10.0.0.1", ["servers"])}
    text = _problems([gpu_spec("q", per_host=1, gpus=2)], inv)
    assert "inventory: hosts a, b are one machine (ssh_hostname 10.0.0.1)" in text and "replicas.per_host" in text


def test_deployments_key_limits_a_host():
    a, b = gpu_spec("chat", per_host=1, gpus=2), gpu_spec("code", per_host=1, gpus=2)
    b["proxy"]["listen"] = 8080  # g1's nginx serves both
    b["server"]["host"] = "0.0.0.0"  # and reaches g2
    inv = {
        "g1": host("10.0.0.1", ["servers", "proxy"], deployments=["chat"]),
        "g2": host("10.0.0.2", ["servers"], deployments=["code"]),
    }
    layout = lay.build([a, b], inv)
    assert [i.id for i in layout.instances("chat")] == ["g1:0"] and [i.id for i in layout.instances("code")] == ["g2:0"]


# ---------------------------------------------------------------------------------------------
# The command line


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


SPEC_TEXT = """name: {name}
model: {{source: /srv/m, transfer: none, max_model_len: 4096, architecture: qwen2.5-7b-instruct}}
parallel: {{tensor: 2}}
replicas: {{per_host: 2}}
server: {{api_key: {{env: K}}, port: {port}}}
proxy: {{listen: {listen}}}
install: {{accelerator: cuda}}
hardware: {{gpu: h100-80gb, gpus_per_node: {gpus}{ids}}}
"""


def test_validate_several_specs_with_an_inventory(tmp_path):
    inv = _write(tmp_path, "inv.py", "servers = [('gpu1', {'ssh_hostname': '10.0.0.1'})]\nproxy = ['gpu1']\n")
    a = _write(
        tmp_path, "a.yaml", SPEC_TEXT.format(name="a", port=8000, listen=80, gpus=4, ids=", gpu_ids: [0, 1, 2, 3]")
    )
    b = _write(tmp_path, "b.yaml", SPEC_TEXT.format(name="b", port=8001, listen=80, gpus=4, ids=""))
    r = cli("validate", str(a), str(b), "--inventory", str(inv))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert (
        "gpu1: GPUs 0, 1 are over-subscribed: vllm-a-0.service 0.9 + vllm-b-0.service 0.9 = 1.8" in r.stderr
        and str(b) in r.stderr
    )
    assert "port 8001 is used by vLLM vllm-a-1.service and by vLLM vllm-b-0.service" in r.stderr
    assert "nothing was changed" in r.stderr
    b.write_text(SPEC_TEXT.format(name="b", port=9000, listen=8080, gpus=4, ids=", gpu_ids: [4, 5, 6, 7]"))
    r = cli("validate", str(a), str(b), "--inventory", str(inv))
    assert r.returncode == 0, r.stderr
    r = cli("render", str(a), str(b), "--inventory", str(inv), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    units = sorted(p.name for p in (tmp_path / "out/gpu1/etc/systemd/system").glob("vllm-*.service"))
    assert units == ["vllm-a-0.service", "vllm-a-1.service", "vllm-b-0.service", "vllm-b-1.service"]


def test_validate_lists_schema_semantic_and_hardware_problems_in_one_run(tmp_path):
    p = _write(
        tmp_path,
        "s.yaml",
        "name: two\nmodel: {source: /srv/m, transfer: none, max_model_len: 512}\n"
        "engine: {max_num_seqs: many, kv_cache_dtype: fp8}\ninstall: {accelerator: cuda}\nhardware: {gpu: rtx3090}\n",
    )
    r = cli("validate", str(p))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "engine.max_num_seqs (line 3): expected integer" in r.stderr  # schema
    assert "proxy.auth: the proxy checks an API key, but server.api_key is not set" in r.stderr  # semantic
    assert "engine.kv_cache_dtype (line 3): FP8 KV cache needs compute capability 8.9+" in r.stderr  # hardware
    assert "3 error(s)" in r.stderr


def test_validate_json_of_a_fleet(tmp_path):
    inv = _write(tmp_path, "inv.py", "servers = [('gpu1', {'ssh_hostname': '10.0.0.1'})]\n")
    a = _write(
        tmp_path,
        "a.yaml",
        SPEC_TEXT.format(name="a", port=8000, listen=80, gpus=4, ids="").replace(
            "replicas: {per_host: 2}", "replicas: {per_host: 3}"
        ),
    )
    r = cli("validate", "--json", str(a), "--inventory", str(inv))
    doc = json.loads(r.stdout)
    # the spec's own check (6 GPUs asked of 4) and the layout's (3 replicas do not fit), in one run
    assert r.returncode == 1 and doc["valid"] is False and doc["specs"][0]["valid"] is False
    assert any("x replicas.per_host 3 = 6 GPUs" in e["message"] for e in doc["specs"][0]["errors"])
    assert any("3 replica(s) x 2 GPU(s)" in line for line in doc["fleet"])


def test_deployments_may_share_a_gpu_when_their_shares_fit():
    """Several deployments on the same gpu_ids: allowed when the --gpu-memory-utilization shares
    sum to at most the GPU (each vLLM takes its share of the whole GPU), refused with the numbers otherwise."""
    inv = {"gpu1": host("10.0.0.1", ["servers", "proxy"])}
    a, b = gpu_spec("chat", tp=1, per_host=1, gpus=1), gpu_spec("code", tp=1, per_host=1, gpus=1, port=9000)
    a["engine"]["gpu_memory_utilization"], b["engine"]["gpu_memory_utilization"] = 0.5, 0.4
    b["proxy"]["listen"] = 81
    layout = lay.build([a, b], inv)
    assert [i.gpu_ids for i in layout.hosts["gpu1"].instances] == [[0], [0]]
    b["engine"]["gpu_memory_utilization"] = 0.6
    text = _problems([a, b], inv)
    assert "GPU 0 is over-subscribed: vllm-chat-0.service 0.5 + vllm-code-0.service 0.6 = 1.1 of its memory" in text


def test_replicas_per_gpu_share_one_gpu_and_start_in_turn():
    from vllm_fleet.render import files as render

    s = gpu_spec("chat", tp=1, per_host=4, gpus=1)
    s["replicas"]["per_gpu"] = 4
    layout = lay.build([s], {"gpu1": host("10.0.0.1", ["servers", "proxy"])})
    insts = layout.hosts["gpu1"].instances
    assert [i.gpu_ids for i in insts] == [[0]] * 4 and [i.port for i in insts] == [8000, 8001, 8002, 8003]
    files = layout.hosts["gpu1"].files
    u0, u2 = (
        files["/etc/systemd/system/vllm-chat-0.service"].content,
        files["/etc/systemd/system/vllm-chat-2.service"].content,
    )
    assert "--gpu-memory-utilization 0.225" in u0 and "wait-replica-health" not in u0
    assert "After=network-online.target vllm-chat-1.service" in u2 and "bin/wait-replica-health 8001 " in u2
    assert any(p.endswith("/bin/wait-replica-health") for p in files)
    s["engine"]["gpu_memory_utilization"] = 0.9
    s["replicas"]["per_host"] = 5  # two GPU groups needed, one GPU
    assert "need 2 GPUs" in _problems([s], {"gpu1": host("10.0.0.1", ["servers", "proxy"])})
