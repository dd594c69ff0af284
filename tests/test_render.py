"""The renderers: the vLLM command line, its environment, and every file a deploy places.

Golden files (tests/golden/<spec>/...) hold the exact output for every example spec; regenerate
them after an intended change with ``UPDATE_GOLDEN=1 pytest tests/test_render.py`` and review the
diff. The other tests check what a user would check, with readers other than the renderer:
bash reads the env files back, systemd's own parser reads the ExecStart= line back, json parses
the speculative config.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_fleet.render import command

from vllm_fleet.render import files as render

from vllm_fleet.specs import load as spec

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
DEPLOYMENTS = sorted((REPO / "deployments").glob("*.yaml"))

#: The 2-node example on a small fleet: head, one worker, nginx on its own host.
INVENTORY_2NODE = {
    "gpu-a": {"address": "10.10.0.11", "groups": ["servers"], "data": {}},
    "gpu-b": {"address": "10.10.0.12", "groups": ["workers"], "data": {}},
    "edge": {"address": "10.10.0.5", "groups": ["proxy"], "data": {}},
}

#: Three replicas, nginx on the first; lab2 out of the upstream (a rollout's batch).
INVENTORY_REPLICAS = {
    "lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}},
    "lab2": {"address": "10.10.0.12", "groups": ["servers"], "data": {"upstream_down": True}},
    "lab3": {"address": "10.10.0.13", "groups": ["servers"], "data": {}},
}


#: Three lab hosts, one replica each, nginx and vLLM's router on lab1 (deployments/lab-tiny-routing.yaml).
INVENTORY_ROUTING = {
    f"lab{i}": {"address": f"10.10.0.1{i}", "groups": ["servers"] + (["proxy"] if i == 1 else []), "data": {}}
    for i in (1, 2, 3)
}


#: The lab's inventory with monitoring on: lab1 runs vLLM, nginx and Prometheus (lab2 untouched).
INVENTORY_LAB_MONITORING = {
    "lab1": {
        "address": "10.10.0.11",
        "groups": ["servers", "proxy", "ray_head", "monitoring"],
        "data": {"private_address": "10.10.0.11"},
    },
    "lab2": {"address": "10.10.0.12", "groups": ["ray_workers"], "data": {"private_address": "10.10.0.12"}},
}


#: The 8xH100 examples (docs/replicas.md): four TP-2 replicas on one host; TP 8 on two hosts
#: whose management (ssh) and cluster (private) addresses differ, nginx on a third.
INVENTORY_8XH100 = {"h100-a": {"address": "10.20.0.11", "groups": ["servers", "proxy"], "data": {}}}
INVENTORY_2X8XH100 = {
    "h100-a": {"address": "mgmt-a.example", "groups": ["servers"], "data": {"private_address": "10.20.0.11"}},
    "h100-b": {"address": "mgmt-b.example", "groups": ["servers"], "data": {"private_address": "10.20.0.12"}},
    "edge": {"address": "10.20.0.5", "groups": ["proxy"], "data": {"private_address": "10.20.0.5"}},
}


def resolved_of(name: str) -> dict:
    return spec.resolve(spec.load(REPO / "deployments" / f"{name}.yaml"))


def _golden_cases():
    cases = [(p.stem, p.stem, None) for p in DEPLOYMENTS]
    cases.append(("2node-ray-pp2+inventory", "2node-ray-pp2", INVENTORY_2NODE))
    cases.append(("lab-tiny-monitoring+inventory", "lab-tiny-monitoring", INVENTORY_LAB_MONITORING))
    cases.append(("lab-tiny-replicas+inventory", "lab-tiny-replicas", INVENTORY_REPLICAS))
    cases.append(("lab-tiny-routing+inventory", "lab-tiny-routing", INVENTORY_ROUTING))
    cases.append(("8xh100-qwen7b-tp2x4+inventory", "8xh100-qwen7b-tp2x4", INVENTORY_8XH100))
    cases.append(("2x8xh100-llama70b-tp8+inventory", "2x8xh100-llama70b-tp8", INVENTORY_2X8XH100))
    return cases


def _rel(path: str) -> str:
    return "HOME/" + path[2:] if path.startswith("~/") else path.lstrip("/")


def _tree(rendered: dict) -> dict[str, str]:
    """{relative golden path: text} including a MANIFEST of modes and owners."""
    out, manifest = {}, []
    for target in sorted(rendered):
        for path in sorted(rendered[target]):
            f = rendered[target][path]
            out[f"{target}/{_rel(path)}"] = f.content
            manifest.append(f"{f.mode:04o} {f.owner or '-'}:{f.group or '-'} {target} {path}")
    out["MANIFEST"] = "\n".join(manifest) + "\n"
    return out


@pytest.mark.parametrize("case,stem,inventory", _golden_cases(), ids=[c[0] for c in _golden_cases()])
def test_golden(case, stem, inventory):
    tree = _tree(render.render(resolved_of(stem), copy.deepcopy(inventory)))
    root = GOLDEN / case
    if os.environ.get("UPDATE_GOLDEN") == "1":
        if root.exists():
            shutil.rmtree(root)
        for rel, text in tree.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    assert root.is_dir(), f"no golden files for {case}: run UPDATE_GOLDEN=1 pytest {__file__}"
    on_disk = {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}
    assert sorted(on_disk) == sorted(tree), "rendered file set differs from the golden one"
    for rel, text in tree.items():
        assert text == on_disk[rel], (
            f"{case}/{rel} differs from the golden file (UPDATE_GOLDEN=1 to accept an intended change)"
        )


def test_golden_dirs_match_the_examples():
    """A removed or renamed example spec must not leave stale golden files behind."""
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(c[0] for c in _golden_cases())


# ---------------------------------------------------------------------------------------------
# The command line


def flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` (None if absent)."""
    return argv[argv.index(name) + 1] if name in argv else None


def test_cpu_build_runs_the_module_with_model_flag():
    r = resolved_of("lab-tiny")
    argv = command.vllm_argv(r)
    assert argv[:3] == ["/opt/vllm-fleet/lab-tiny/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == "/var/lib/vllm-fleet/lab-tiny/model"
    assert flag(argv, "--served-model-name") == "tiny"
    assert flag(argv, "--max-model-len") == "512"
    assert "--gpu-memory-utilization" not in argv  # the CPU build sizes KV cache from VLLM_CPU_KVCACHE_SPACE
    assert "--enforce-eager" in argv
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "8000"


def test_cuda_single_gpu_awq():
    argv = command.vllm_argv(resolved_of("rtx3090-qwen7b-awq-realtime"))
    assert argv[:3] == [
        "/opt/vllm-fleet/qwen7b-awq-rt/env/bin/vllm",
        "serve",
        "/var/lib/vllm-fleet/qwen7b-awq-rt/model",
    ]
    assert flag(argv, "--quantization") == "awq_marlin"
    assert flag(argv, "--dtype") == "float16"
    assert flag(argv, "--gpu-memory-utilization") == "0.9"
    assert flag(argv, "--max-num-seqs") == "16"
    assert "--enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    for absent in (
        "--tensor-parallel-size",
        "--distributed-executor-backend",
        "--kv-cache-dtype",
        "--enforce-eager",
        "--model",
    ):
        assert absent not in argv


def test_tp4_fp8_batch():
    argv = command.vllm_argv(resolved_of("4xh100-qwen32b-tp4"))
    assert flag(argv, "--tensor-parallel-size") == "4"
    assert flag(argv, "--kv-cache-dtype") == "fp8"
    assert flag(argv, "--quantization") == "fp8"
    assert flag(argv, "--max-num-batched-tokens") == "16384"
    assert flag(argv, "--max-num-seqs") == "256"
    assert flag(argv, "--gpu-memory-utilization") == "0.92"
    assert flag(argv, "--max-model-len") == "32768"
    assert "--pipeline-parallel-size" not in argv


def test_two_nodes_over_ray():
    argv = command.vllm_argv(resolved_of("2node-ray-pp2"))
    assert flag(argv, "--distributed-executor-backend") == "ray"
    assert flag(argv, "--tensor-parallel-size") == "2" and flag(argv, "--pipeline-parallel-size") == "2"
    assert flag(argv, "--host") == "0.0.0.0"
    with pytest.raises(ValueError):
        command.vllm_argv(resolved_of("2node-ray-pp2"), role="worker", node_rank=1)  # Ray workers run `ray start`


def _native(r: dict) -> dict:
    r = copy.deepcopy(r)
    r["parallel"]["backend"] = "native"
    return r


def test_native_multinode_head_and_headless_worker():
    r = _native(resolved_of("2node-ray-pp2"))
    head = command.vllm_argv(r)
    worker = command.vllm_argv(r, role="worker", node_rank=1)
    for argv, rank in ((head, "0"), (worker, "1")):
        assert flag(argv, "--nnodes") == "2"
        assert flag(argv, "--node-rank") == rank
        assert flag(argv, "--master-addr") == "10.10.0.11"
        assert flag(argv, "--master-port") == "29501"
        assert flag(argv, "--distributed-executor-backend") == "mp"
    assert "--headless" in worker and "--headless" not in head
    assert "--port" not in worker and flag(head, "--port") == "8000"


def test_explicit_off_switches_speculative_json_and_extra_args_last():
    r = resolved_of("rtx3090-qwen7b-awq-batch")
    r["engine"].update(
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5},
        extra_args=["--load-format", "dummy", "--seed", "7"],
    )
    argv = command.vllm_argv(r)
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert "--no-enable-chunked-prefill" in argv and "--enable-chunked-prefill" not in argv
    assert json.loads(flag(argv, "--speculative-config")) == r["engine"]["speculative"]
    assert argv[-4:] == ["--load-format", "dummy", "--seed", "7"]


def test_vllm_env():
    cpu = command.vllm_env(resolved_of("lab-tiny"))
    assert cpu["HF_HUB_OFFLINE"] == "1" and cpu["VLLM_NO_USAGE_STATS"] == "1" and cpu["DO_NOT_TRACK"] == "1"
    assert cpu["VLLM_CPU_KVCACHE_SPACE"] == "1"
    for key in ("VLLM_CACHE_ROOT", "TMPDIR", "HF_HOME"):
        assert cpu[key].startswith("/var/lib/vllm-fleet/lab-tiny/")
    gpu = command.vllm_env(resolved_of("4xh100-qwen32b-tp4"))
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu
    r = resolved_of("lab-tiny")
    r["env"] = {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "0"}
    env = command.vllm_env(r)
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG" and env["HF_HUB_OFFLINE"] == "0"  # the spec wins
    r["env"] = {"VLLM_API_KEY": "x"}
    with pytest.raises(ValueError):
        command.vllm_env(r)


def test_cpu_tp2_binds_one_cpu_range_per_rank():
    r = resolved_of("lab-tiny")
    r["parallel"]["tensor"] = 2
    env = render.render(r)["server"]["/etc/vllm-fleet/lab-tiny/replica-0.env"].content
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in env.splitlines()
    inv = {"lab1": {"address": "10.10.0.11", "groups": ["servers"], "data": {"cpu_count": 8}}}
    env = render.render(r, inv)["lab1"]["/etc/vllm-fleet/lab-tiny/replica-0.env"].content
    assert "VLLM_CPU_OMP_THREADS_BIND=0-3|4-7" in env.splitlines()


# ---------------------------------------------------------------------------------------------
# Read back with independent readers


def _bash_env(path: Path) -> dict[str, str]:
    script = f'set -a; . "{path}"; set +a; exec python3 -c "import json,os; print(json.dumps(dict(os.environ)))"'
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, check=True
    )
    return json.loads(out.stdout)


def test_env_files_read_back_by_a_shell(tmp_path):
    tricky = {"PLAIN": "a-b/c:1", "SPACES": "two words", "QUOTE": "it's \"x\" $HOME `id` \\n", "EMPTY": ""}
    f = tmp_path / "x.env"
    f.write_text(render.env_file(tricky, ["comment"]))
    env = _bash_env(f)
    for k, v in tricky.items():
        assert env[k] == v, k
    for case, stem, inv in _golden_cases():
        for target, files in render.render(resolved_of(stem), copy.deepcopy(inv)).items():
            for path, rf in files.items():
                if path.endswith("vllm.env"):
                    f.write_text(rf.content)
                    expected = command.vllm_env(resolved_of(stem))
                    read = _bash_env(f)
                    assert {k: read[k] for k in expected} == expected


def _systemd_dump_words(text: str) -> list[str]:
    """Split systemd 252's "Command Line:" dump (quote_command_line: words in double quotes when
    needed, with C escapes: \\n, \\t, \\xNN, and \\\\, \\", \\$, \\`) into the words systemd holds."""
    words, cur, quoted, i, started = [], [], False, 0, False
    esc = {
        "n": "\n",
        "t": "\t",
        "r": "\r",
        "\\": "\\",
        '"': '"',
        "$": "$",
        "`": "`",
        "'": "'",
        "a": "\a",
        "b": "\b",
        "f": "\f",
        "v": "\v",
    }
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            n = text[i + 1]
            if n == "x":
                cur.append(chr(int(text[i + 2 : i + 4], 16)))
                i += 4
                continue
            cur.append(esc.get(n, n))
            i += 2
            started = True
            continue
        if c == '"':
            quoted = not quoted
            started = True
        elif c == " " and not quoted:
            if started or cur:
                words.append("".join(cur))
            cur, started = [], False
        else:
            cur.append(c)
            started = True
        i += 1
    if started or cur:
        words.append("".join(cur))
    return words


def _at_exec(word: str) -> str:
    """What systemd passes to the process for one ExecStart= word (systemd.service(5): "$$"
    is a literal "$"; "$NAME" and "${NAME}" are replaced by the variable, here marked <$NAME>)."""
    return re.sub(
        r"\$\$|\$\{(\w+)\}|\$(\w+)", lambda m: "$" if m.group(0) == "$$" else f"<${m.group(1) or m.group(2)}>", word
    )


def _systemd_argv(unit_text: str, tmp_path: Path, stub: str) -> list[str]:
    """ExecStart= as systemd 252 parses it (its debug dump of the loaded unit: specifiers
    resolved, C escapes undone), then as it executes it (variables expanded)."""
    from test_rendered_validity import systemd_root

    root = systemd_root(tmp_path / "root", [stub])
    (root / "etc/systemd/system/probe.service").write_text(unit_text)
    out = subprocess.run(
        ["systemd-analyze", f"--root={root}", "verify", "/etc/systemd/system/probe.service"],
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "debug"},
    )
    lines = [l.strip() for l in (out.stdout + out.stderr).splitlines() if l.strip().startswith("Command Line:")]
    if not lines:  # systemd refused the line (a raw newline splits it): nothing like the argv
        return ["<systemd refused the unit>", out.stderr[-500:]]
    return [_at_exec(w) for w in _systemd_dump_words(lines[0].split(":", 1)[1].strip())]


#: Arguments that need every escaping rule of systemd_quote: "$" (variable expansion), "%"
#: (specifiers, also mid-word), a newline and a tab (C escapes), backslashes and quotes.
_HOSTILE_ARGS = [
    "--chat-template",
    "{{ '$x' }}\\n\"q\"",
    "--seed",
    "7;",
    "--a",
    "a$HOME",
    "--b",
    "${PATH}x",
    "--c",
    "c%nd",
    "--d",
    "100%",
    "--e",
    "line1\nline2",
    "--f",
    "t\tz",
    "--g",
    "back\\slash",
    "--h",
    "q'\"",
    "--i",
    "$$",
]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_reads_the_command_line_back_unchanged(tmp_path):
    r = resolved_of("rtx3090-qwen7b-awq-realtime")
    r["model"]["served_name"] = "my model 100%"
    r["engine"]["speculative"] = {"method": "ngram", "num_speculative_tokens": 4}
    r["engine"]["extra_args"] = list(_HOSTILE_ARGS)
    argv = command.vllm_argv(r)
    unit = "[Service]\nExecStart=" + render.systemd_command(argv) + "\n"
    assert _systemd_argv(unit, tmp_path, argv[0]) == argv


def _without(rule: str):
    """systemd_quote with one escaping rule removed (what the read-back must catch)."""

    def quote(arg: str) -> str:
        s = str(arg)
        if rule != "%":
            s = s.replace("%", "%%")
        if rule != "$":
            s = s.replace("$", "$$")
        s = s.replace("\\", "\\\\").replace('"', '\\"')
        if rule != "\n":
            s = s.replace("\n", "\\n")
        s = s.replace("\t", "\\t")
        return f'"{s}"'

    return quote


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("rule", ["$", "%", "\n"])
def test_the_read_back_catches_each_missing_escape(tmp_path, rule):
    """Each rule of systemd_quote, removed, makes systemd read another command line."""
    argv = ["/usr/bin/probe", *_HOSTILE_ARGS]
    good = "[Service]\nExecStart=" + " ".join(_without("none")(a) for a in argv) + "\n"
    assert _systemd_argv(good, tmp_path / "good", argv[0]) == argv  # the harness' own quoter is right
    bad = "[Service]\nExecStart=" + " ".join(_without(rule)(a) for a in argv) + "\n"
    assert _systemd_argv(bad, tmp_path / "bad", argv[0]) != argv


# ---------------------------------------------------------------------------------------------
# Files and their placement


def test_targets_without_inventory():
    assert sorted(render.render(resolved_of("lab-tiny"))) == ["client", "proxy", "server"]
    assert sorted(render.render(resolved_of("2node-ray-pp2"))) == [
        "client",
        "proxy",
        "ray-head",
        "ray-worker",
        "server",
    ]
    assert sorted(render.render(_native(resolved_of("2node-ray-pp2")))) == ["client", "proxy", "server", "worker"]


def test_modes_and_owners():
    out = render.render(resolved_of("lab-tiny"))
    srv = out["server"]
    assert (srv["/etc/vllm-fleet/lab-tiny/secrets.env"].mode, srv["/etc/vllm-fleet/lab-tiny/secrets.env"].owner) == (
        0o600,
        "root",
    )
    assert (
        srv["/etc/vllm-fleet/lab-tiny/vllm.env"].mode == 0o640
        and srv["/etc/vllm-fleet/lab-tiny/vllm.env"].group == "vllm"
    )
    assert srv["/etc/systemd/system/vllm-lab-tiny-0.service"].mode == 0o644
    assert out["proxy"]["/etc/nginx/vllm-fleet/lab-tiny-auth.conf"].mode == 0o600
    with pytest.raises(Exception):
        srv["/etc/systemd/system/vllm-lab-tiny-0.service"].mode = 0o777  # frozen


def test_unit_runs_the_rendered_command_as_the_service_user():
    r = resolved_of("lab-tiny")
    unit = render.render(r)["server"]["/etc/systemd/system/vllm-lab-tiny-0.service"].content
    assert f"ExecStart={render.systemd_command(command.vllm_argv(r))}" in unit.splitlines()
    for line in (
        "User=vllm",
        "Group=vllm",
        "EnvironmentFile=/etc/vllm-fleet/lab-tiny/secrets.env",
        "Restart=on-failure",
        "TimeoutStartSec=900",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/vllm-fleet/lab-tiny",
        "NoNewPrivileges=yes",
        "WorkingDirectory=/var/lib/vllm-fleet/lab-tiny/replica-0",
        "EnvironmentFile=/etc/vllm-fleet/lab-tiny/replica-0.env",
    ):
        assert line in unit.splitlines()
    assert "MemoryDenyWriteExecute=" not in unit  # torch JIT and Triton write code


def test_gpu_units_leave_devices_open():
    """ProtectClock/PrivateDevices/DeviceAllow would build a device allow-list without /dev/nvidia*."""
    for stem in ("rtx3090-qwen7b-awq-realtime", "2node-ray-pp2"):
        for files in render.render(resolved_of(stem)).values():
            for path, f in files.items():
                if path.endswith(".service"):
                    for bad in ("ProtectClock=", "PrivateDevices=", "DeviceAllow=", "DevicePolicy="):
                        assert bad not in f.content, (path, bad)


def test_two_node_ray_with_inventory():
    out = render.render(resolved_of("2node-ray-pp2"), copy.deepcopy(INVENTORY_2NODE))
    assert sorted(out) == ["client", "edge", "gpu-a", "gpu-b"]
    a, b, edge = out["gpu-a"], out["gpu-b"], out["edge"]
    assert {"/etc/systemd/system/vllm-llama70b-2node-0.service", "/etc/systemd/system/ray-head.service"} <= set(a)
    assert (
        not [p for p in b if p.startswith("/etc/systemd/system/vllm-llama70b")]
        and "/etc/systemd/system/ray-worker.service" in b
    )
    assert "/etc/vllm-fleet/llama70b-2node/secrets.env" not in b  # only where the API is served
    assert "VLLM_HOST_IP=10.10.0.12" in b["/etc/vllm-fleet/llama70b-2node/node.env"].content.splitlines()
    assert "VLLM_HOST_IP=10.10.0.11" in a["/etc/vllm-fleet/llama70b-2node/node.env"].content.splitlines()
    assert "GLOO_SOCKET_IFNAME=eth1" in b["/etc/vllm-fleet/llama70b-2node/node.env"].content.splitlines()
    worker_unit = b["/etc/systemd/system/ray-worker.service"].content
    assert "--address 10.10.0.11:6379" in worker_unit and "--node-ip-address ${NODE_IP}" in worker_unit
    assert "EnvironmentFile=/etc/vllm-fleet/llama70b-2node/node.env" in worker_unit.splitlines()
    vllm_unit = a["/etc/systemd/system/vllm-llama70b-2node-0.service"].content
    assert "Requires=ray-head.service" in vllm_unit.splitlines()
    pre = [l for l in vllm_unit.splitlines() if l.startswith("ExecStartPre=")]
    # /dev/nvidia-uvm first (as root: `+`), then the cluster wait
    assert pre[0] == "ExecStartPre=-+/usr/bin/nvidia-modprobe -c0 -u"
    assert len(pre) == 2 and "--nodes 2 --gpus 4" in pre[1] and "--expect 10.10.0.11 --expect 10.10.0.12" in pre[1]
    site = edge["/etc/nginx/conf.d/vllm-fleet-llama70b-2node.conf"].content
    assert (
        "server 10.10.0.11:8000 max_fails=2 fail_timeout=10s;" in site
    )  # nginx on its own host reaches the head over the network
    assert (
        json.loads(out["client"]["~/.config/vllm-fleet/llama70b-2node/openai.json"].content)["base_url"]
        == "http://10.10.0.5/v1"
    )


def test_inventory_mistakes_are_reported():
    r = resolved_of("2node-ray-pp2")
    bad_head = copy.deepcopy(INVENTORY_2NODE)
    bad_head["gpu-a"]["address"] = "10.10.0.99"
    with pytest.raises(render.RenderError, match="head_address"):
        render.render(r, bad_head)
    one_node = {k: v for k, v in copy.deepcopy(INVENTORY_2NODE).items() if k != "gpu-b"}
    with pytest.raises(render.RenderError, match="parallel.nodes is 2"):
        render.render(r, one_node)
    local_only = {
        "s": {"address": "10.0.0.2", "groups": ["servers"]},
        "p": {"address": "10.0.0.3", "groups": ["proxy"]},
    }
    with pytest.raises(render.RenderError, match="server.host"):
        render.render(resolved_of("lab-tiny"), local_only)


def test_proxy_same_host_uses_loopback_and_tls_changes_scheme():
    r = resolved_of("lab-tiny")
    r["proxy"]["tls"]["enabled"] = True
    r["proxy"]["listen"] = 443
    inv = {"lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}}}
    out = render.render(r, inv)
    site = out["lab1"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    assert "server 127.0.0.1:8000 max_fails=2 fail_timeout=10s;" in site and "listen 443 ssl default_server;" in site
    assert "ssl_certificate /etc/nginx/vllm-fleet/lab-tiny.crt;" in site
    assert (
        json.loads(out["client"]["~/.config/vllm-fleet/lab-tiny/openai.json"].content)["base_url"]
        == "https://10.10.0.11/v1"
    )


# ---------------------------------------------------------------------------------------------
# Secrets


def test_no_rendered_file_contains_the_secret(tmp_path):
    key = "sk-" + secrets.token_urlsafe(32)
    key_file = tmp_path / "api.key"
    key_file.write_text(key + "\n")
    os.chmod(key_file, 0o600)
    for case, stem, inv in _golden_cases():
        r = resolved_of(stem)
        r["server"]["api_key"] = {"file": str(key_file)}
        assert key not in " ".join(command.vllm_argv(r))
        for target, files in render.render(r, copy.deepcopy(inv)).items():
            for path, f in files.items():
                assert key not in f.content, f"{case}: {target}:{path} contains the API key"
                assert key[3:20] not in f.content
    # where the value does go: only through the two deploy-time functions
    r = resolved_of("lab-tiny")
    assert f"VLLM_API_KEY={key}" in render.secrets_env_content(r, key).splitlines()
    assert f'"~^Bearer {re.escape(key)}$" 1;' in render.nginx_auth_content(r, key)
    with pytest.raises(render.RenderError):
        render.nginx_auth_content(r, 'bad" key')


# ---------------------------------------------------------------------------------------------
# The Ray cluster wait (ExecStartPre of vllm.service on a Ray head), against a stand-in `ray`

FAKE_RAY = '''
import json, os
def init(**kw):
    if os.environ.get("FAKE_RAY_DOWN"):
        raise ConnectionError("head not reachable")
def shutdown():
    pass
def nodes():
    return json.loads(os.environ["FAKE_RAY_NODES"])
'''


def _wait(tmp_path, nodes, *args, down=False):
    r = resolved_of("2node-ray-pp2")
    script = render.render(r, copy.deepcopy(INVENTORY_2NODE))["gpu-a"][
        "/opt/vllm-fleet/llama70b-2node/bin/wait-ray-cluster"
    ]
    assert script.mode == 0o755
    (tmp_path / "wait").write_text(script.content)
    (tmp_path / "ray.py").write_text(FAKE_RAY)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path), "FAKE_RAY_NODES": json.dumps(nodes)}
    if down:
        env["FAKE_RAY_DOWN"] = "1"
    return subprocess.run(
        ["python3", str(tmp_path / "wait"), "--address", "10.10.0.11:6379", *args, "--interval", "0.05"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


def test_wait_ray_cluster_ready_and_timeout(tmp_path):
    a = {"Alive": True, "NodeManagerAddress": "10.10.0.11", "Resources": {"GPU": 2.0, "CPU": 32.0}}
    b = {"Alive": True, "NodeManagerAddress": "10.10.0.12", "Resources": {"GPU": 2.0}}
    args = ["--nodes", "2", "--gpus", "4", "--expect", "10.10.0.11", "--expect", "10.10.0.12", "--timeout", "0.3"]
    ok = _wait(tmp_path, [a, b], *args)
    assert ok.returncode == 0 and "ready: 2 node(s)" in ok.stdout
    dead_b = _wait(tmp_path, [a, {**b, "Alive": False}], *args)
    assert dead_b.returncode == 1
    assert "missing node(s): 10.10.0.12" in dead_b.stderr and "nodes: 1 of 2" in dead_b.stderr
    few_gpus = _wait(tmp_path, [a, {**b, "Resources": {"GPU": 0}}], *args)
    assert few_gpus.returncode == 1 and "GPUs: 2 of 4" in few_gpus.stderr
    down = _wait(tmp_path, [], *args, down=True)
    assert down.returncode == 1 and "head not reachable" in down.stderr


def test_cuda_units_make_nvidia_uvm_and_keep_caches_under_the_state_dir():
    """A GPU vllm.service creates /dev/nvidia-uvm as root before vLLM starts, is ordered after the
    driver's services, and every JIT cache (and HOME) is under the only writable directory."""
    r = resolved_of("h200-qwen7b-bf16")
    state, prefix = r["install"]["state_dir"], r["install"]["prefix"]
    env = command.vllm_env(r)
    for key, sub in [
        ("HOME", ""),
        ("FLASHINFER_WORKSPACE_BASE", "/cache/flashinfer"),
        ("DG_JIT_CACHE_DIR", "/cache/deep_gemm"),
        ("CUDA_CACHE_PATH", "/cache/nv"),
    ]:
        assert env[key] == state + sub, key
    # XDG/Triton caches are per replica (issue 14): under the replica's state dir, also writable
    rep = command.state_env(f"{state}/replica-0")
    assert rep["XDG_CACHE_HOME"].startswith(state + "/") and rep["TRITON_CACHE_DIR"].startswith(state + "/")
    assert env["PATH"].split(":")[0] == f"{prefix}/env/bin" and "/usr/bin" in env["PATH"].split(":")
    out = {p: f for files in render.render(r).values() for p, f in files.items()}
    unit = next(
        f.content for p, f in out.items() if p.startswith("/etc/systemd/system/vllm-") and p.endswith(".service")
    ).splitlines()
    assert "ExecStartPre=-+/usr/bin/nvidia-modprobe -c0 -u" in unit
    assert unit.index("ExecStartPre=-+/usr/bin/nvidia-modprobe -c0 -u") < next(
        i for i, l in enumerate(unit) if l.startswith("ExecStart=")
    )
    assert "After=nvidia-persistenced.service nvidia-fabricmanager.service" in unit
    # the system call filter proven with CUDA on the H200 (bench/results/h200-systemd-*.json)
    assert "SystemCallFilter=@system-service" in unit and "SystemCallErrorNumber=EPERM" in unit
    vllm_env_file = next(f.content for p, f in out.items() if p.endswith("/vllm.env")).splitlines()
    assert f"DG_JIT_CACHE_DIR={state}/cache/deep_gemm" in vllm_env_file
    # the CPU build: none of it
    cpu = resolved_of("lab-tiny")
    assert "HOME" not in command.vllm_env(cpu) and "CUDA_CACHE_PATH" not in command.vllm_env(cpu)
    cpu_unit = next(
        f.content
        for files in render.render(cpu).values()
        for p, f in files.items()
        if p.startswith("/etc/systemd/system/vllm-") and p.endswith(".service")
    )
    assert "nvidia-modprobe" not in cpu_unit and "nvidia-persistenced" not in cpu_unit


def test_vllms_path_uses_the_env_of_a_prefix_written_with_a_trailing_slash():
    raw = spec.loads((REPO / "deployments" / "lab-tiny.yaml").read_text()).raw
    raw["install"] = {**(raw.get("install") or {}), "prefix": "/opt/vllm-fleet/x/", "accelerator": "cuda"}
    resolved = spec.resolve(spec.loads(json.dumps(raw)))
    env = command.vllm_env(resolved)
    assert env["PATH"].split(":")[0] == "/opt/vllm-fleet/x/env/bin" == command.env_paths(resolved)["env"] + "/bin"


def test_a_prefix_written_with_a_trailing_slash_gives_no_double_slash_anywhere():
    """install.prefix "/opt/vf/x/" (the schema allows the slash): resolve keeps one spelling, so
    no path the deploy places or names (the router's venv, the wait scripts, the env) and no
    rendered file holds "x//"."""
    text = (REPO / "deployments" / "lab-tiny-routing.yaml").read_text()
    raw = spec.loads(text).raw
    raw.setdefault("install", {})["prefix"] = "/opt/vf/x/"
    resolved = spec.resolve(spec.loads(json.dumps(raw)))
    assert resolved["install"]["prefix"] == "/opt/vf/x"
    assert [k for k, v in render.paths(resolved).items() if "//" in v] == []
    rendered = render.render(resolved, INVENTORY_ROUTING)
    assert [(h, p) for h, files in rendered.items() for p, f in files.items() if "x//" in p or "x//" in f.content] == []
    assert any("/opt/vf/x/router/bin/vllm-router" in f.content for files in rendered.values() for f in files.values())


@pytest.mark.parametrize("case,stem,inventory", _golden_cases(), ids=[c[0] for c in _golden_cases()])
def test_every_rendered_file_names_its_deployment_and_part(case, stem, inventory):
    """Each file of the layout says whose it is (RenderedFile.deployment, .part): a role places
    exactly HostLayout.files_of(its deployment, its part), and a path the layout stops rendering is
    removed by the part that declares it (render.part_paths), so every rendered path must be
    declared by its own part (a replica's unit or env file: the service's, by name). A file
    rendered without its part declaring it (e.g. a new .mount unit) would be placed and never
    removed: this fails."""
    from pathlib import PurePosixPath

    from vllm_fleet.render.layout import build

    resolved = resolved_of(stem)
    layout = build([resolved], copy.deepcopy(inventory))
    name, declared = resolved["name"], render.part_paths(resolved)
    replica = [f"/etc/systemd/system/vllm-{name}-*.service", f"{resolved['install']['config_dir']}/replica-*.env"]
    seen = set()
    for h in layout.hosts.values():
        for path, f in h.files.items():
            assert f.part in render.PARTS and f.deployment in (name, ""), (h.name, path, f.deployment, f.part)
            assert path in declared[f.part] or (
                f.part == "service" and any(PurePosixPath(path).match(g) for g in replica)
            ), (h.name, path, f.part)
            assert h.files_of(f.deployment, f.part)[path] is f
            seen.add(f.part)
        # the parts' files are the host's files, each once
        assert sum(len(h.files_of(d, p)) for d in (name, "") for p in render.PARTS) == len(h.files)
    assert {f.part for f in layout.client.values()} == {"client"}
    assert "service" in seen and ("nginx" in seen) == bool(resolved["proxy"]["enabled"])
