"""The inventory, its host data and the command line are input too (issue 21).

Every check reads what a user reads (the CLI's exit status and stderr, from a separate process,
or the files ``render`` writes, read back by nginx / nft); inventories hold only TEST-NET
addresses (192.0.2.0/24) and nothing here connects to them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fleetutil import REPO, run_cli

SPEC = REPO / "deployments" / "lab-tiny.yaml"


def _spec(tmp_path: Path, name: str = "lab-tiny", **changes) -> Path:
    """lab-tiny, listening beyond loopback (a proxy on another host reaches it), plus ``changes``
    ({section: {key: value}})."""
    data = yaml.safe_load(SPEC.read_text())
    data["name"] = name
    data["server"]["host"] = "0.0.0.0"
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _write(tmp_path: Path, text: str, name: str = "inv.py") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------------------------------------
# Class 13: an inventory file that exits, raises or calls os._exit is an input error

EXITS = {
    "sys.exit(3)": "import sys\nservers = ['a']\nsys.exit(3)\n",
    "KeyboardInterrupt": "servers = ['a']\nraise KeyboardInterrupt\n",
    "os._exit(0)": "import os\nservers = ['a']\nos._exit(0)\n",
}

COMMANDS = {
    "validate": lambda inv: ["validate", str(SPEC), "--inventory", str(inv)],
    "render": lambda inv: ["render", str(SPEC), "--inventory", str(inv), "--out", str(inv.parent / "out")],
    "rollout": lambda inv: ["rollout", str(inv), "--spec", str(SPEC), "--dry"],
    "bench": lambda inv: ["bench", str(inv), "--spec", str(SPEC)],
    "tune": lambda inv: ["tune", str(inv), "--spec", str(SPEC), "--target", "ttft_p99_ms=500", "--dry"],
    "status": lambda inv: ["status", str(inv), "--spec", str(SPEC)],
}


@pytest.mark.parametrize("how", list(EXITS))
def test_an_inventory_that_exits_is_an_input_error(tmp_path, how):
    inv = _write(tmp_path, EXITS[how])
    r = run_cli(*COMMANDS["validate"](inv))
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert str(inv) in r.stderr and "Traceback" not in r.stderr and "valid" not in r.stdout, r.stderr


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "validate"])
def test_every_command_refuses_an_inventory_that_calls_os_exit(tmp_path, command):
    inv = _write(tmp_path, EXITS["os._exit(0)"])
    r = run_cli(*COMMANDS[command](inv))
    assert r.returncode == 1, (command, r.returncode, r.stdout, r.stderr)
    assert str(inv) in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_every_command_reads_group_data_as_the_deploy_does(tmp_path):
    """group_data/servers.py beside the inventory is pyinfra's: validate sees its private_address."""
    inv = _write(
        tmp_path,
        "servers = [('gpu1', {'ssh_hostname': '192.0.2.10'})]\nproxy = [('lb', {'ssh_hostname': '192.0.2.20'})]\n",
    )
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "servers.py").write_text("private_address = '192.0.2.99'\n")
    out = tmp_path / "out"
    r = run_cli("render", str(_spec(tmp_path)), "--inventory", str(inv), "--out", str(out))
    assert r.returncode == 0, r.stderr
    site = next((out / "lb").rglob("vllm-fleet-*.conf")).read_text()
    assert "192.0.2.99:" in site and "192.0.2.10:" not in site, site


def test_the_servers_group_order_is_kept(tmp_path):
    """pyinfra keeps groups in `all` order; the reader keeps the order the group lists them."""
    from vllm_fleet.specs.inventory import load_inventory

    inv = _write(tmp_path, "proxy = ['b']\nservers = ['c', 'b', 'a']\n")
    hosts = load_inventory(inv)
    assert sorted(hosts, key=lambda n: hosts[n]["order"]["servers"]) == ["c", "b", "a"]


# ---------------------------------------------------------------------------------------------
# Host data: checked like the spec (classes 1, 4, 8, 9, 10)

#: host -> (its data, the key its message must name). Every host here is wrong in one key.
BAD_HOSTS = {
    "inject": (
        {"private_address": "192.0.2.5:8000; } server { listen 81; location / { proxy_pass http://192.0.2.6; } #"},
        "private_address",
    ),
    "newline": ({"private_address": "192.0.2.5\n}"}, "private_address"),
    "blank": ({"private_address": " "}, "private_address"),
    "negative": ({"private_address": -1}, "private_address"),
    "hostport": ({"ssh_hostname": "192.0.2.7:22"}, "ssh_hostname"),
    "trailing": ({"ssh_hostname": "192.0.2.8 "}, "ssh_hostname"),
    "zero": ({"replicas_per_host": 0}, "replicas_per_host"),
    "minus": ({"replicas_per_host": -2}, "replicas_per_host"),
    "huge": ({"replicas_per_host": 10**9}, "replicas_per_host"),
    "words": ({"replicas_per_host": "two"}, "replicas_per_host"),
    "mapzero": ({"replicas_per_host": {"lab-tiny": 0}}, "replicas_per_host['lab-tiny']"),
    "substring": ({"deployments": "lab-tiny-2"}, "deployments"),
    "float": ({"deployments": 1.0}, "deployments"),
    "cpus": ({"cpu_count": "lots"}, "cpu_count"),
    "allowint": ({"vllm_api_firewall_allow": 10}, "vllm_api_firewall_allow"),
    "allowstr": ({"ray_firewall_allow": "10.0.0.0/8"}, "ray_firewall_allow"),
    "allowbad": ({"vllm_api_firewall_allow": ["10.0.0.0/33"]}, "vllm_api_firewall_allow[0]"),
    "rayunits": ({"ray_memory_bytes": "8G"}, "ray_memory_bytes"),
    "raynegative": ({"ray_object_store_bytes": -1}, "ray_object_store_bytes"),
}


def _layout_inventory(hosts: dict) -> dict:
    """{host: {"address", "groups", "data"}}, as the layout takes an inventory."""
    out = {}
    for i, (n, d) in enumerate(hosts.items()):
        data = {"ssh_hostname": "192.0.2.%d" % (10 + i), **d}
        out[n] = {"address": data["ssh_hostname"], "groups": ["servers"], "data": data}
    return out


@pytest.mark.parametrize("host", list(BAD_HOSTS))
def test_bad_host_data_is_refused_naming_host_key_and_fix(host):
    from vllm_fleet.render.layout import LayoutError, build
    from vllm_fleet.specs.load import load_and_check

    resolved, _ = load_and_check(str(SPEC))
    data, key = BAD_HOSTS[host]
    with pytest.raises(LayoutError) as exc:
        build([resolved], _layout_inventory({host: data}))
    text = str(exc.value)
    assert f"host {host}: data {key} = " in text and "expected " in text and "e.g." in text, text


def test_every_bad_host_at_once_from_the_cli_exit_1_no_traceback(tmp_path):
    """One inventory, every bad host: validate prints each (host and key), exit 1, in bounded time
    (replicas_per_host 10**9 is refused, not expanded)."""
    rows = ",\n".join(
        f"    ({n!r}, {{'ssh_hostname': '192.0.2.{10 + i}', **{d!r}}})"
        for i, (n, (d, _)) in enumerate(BAD_HOSTS.items())
    )
    inv = _write(tmp_path, f"servers = [\n{rows}\n]\n")
    r = run_cli("validate", str(SPEC), "--inventory", str(inv))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    for host, (_, key) in BAD_HOSTS.items():
        assert f"host {host}: data {key} = " in r.stderr, (host, r.stderr)
    out = tmp_path / "out"
    r = run_cli("render", str(SPEC), "--inventory", str(inv), "--out", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr and not out.exists(), r.stderr


def test_a_host_name_that_is_no_address_is_refused():
    from vllm_fleet.render.layout import LayoutError, build
    from vllm_fleet.specs.load import load_and_check

    resolved, _ = load_and_check(str(SPEC))
    with pytest.raises(LayoutError, match=r"host gpu_1: .*set ssh_hostname"):
        build([resolved], {"gpu_1": {"address": "gpu_1", "groups": ["servers"], "data": {}}})


def test_deployments_is_a_list_not_a_substring(tmp_path):
    """Class 8: `deployments: "lab-tiny-2"` used to match deployment lab-tiny as a substring."""
    from vllm_fleet.render.layout import LayoutError, build
    from vllm_fleet.specs.load import load_and_check

    resolved, _ = load_and_check(str(SPEC))
    with pytest.raises(LayoutError, match="a list, even for one"):
        build([resolved], _layout_inventory({"gpu1": {"deployments": "lab-tiny-2"}}))
    layout = build([resolved], _layout_inventory({"gpu1": {"deployments": ["lab-tiny-2"]}, "gpu2": {}}))
    assert [i.host for i in layout.instances()] == ["gpu2"]


def test_ports_past_65535_are_refused(tmp_path):
    """Class 2: server.port 65535 and 2 replicas would listen on 65536."""
    from vllm_fleet.render.layout import LayoutError, build
    from vllm_fleet.specs.load import load_and_check

    resolved, _ = load_and_check(str(_spec(tmp_path, server={"port": 65535, "host": "0.0.0.0"})))
    with pytest.raises(LayoutError, match=r"past the last TCP port 65535: set server.port to at most 65534"):
        build([resolved], _layout_inventory({"gpu1": {"replicas_per_host": 2}}))


# ---------------------------------------------------------------------------------------------
# The fleet check: every listening port, every GPU (classes 6, 7, 12), firewalls nft accepts (3),
# names nginx accepts (5), CPU native multi-node (11)


def _resolved(path):
    from vllm_fleet.specs.load import load_and_check

    return load_and_check(str(path))[0]


def _fleet(tmp_path, specs, inventory):
    """``vllm-fleet validate SPEC... --inventory INV`` in a separate process."""
    inv = _write(tmp_path, inventory, "fleet-inv.py")
    return run_cli("validate", "--no-hardware", *map(str, specs), "--inventory", str(inv))


def test_a_multi_node_deployment_without_gpu_ids_owns_every_gpu(tmp_path):
    """Class 6: 2node-ray-pp2 (no gpu_ids) on gpu-a/gpu-b, and a one-GPU replica on gpu-b."""
    other = tmp_path / "one.yaml"
    data = yaml.safe_load((REPO / "deployments" / "h200-qwen7b-bf16.yaml").read_text())
    data.update(name="one")
    data["hardware"] = {**data["hardware"], "gpu_ids": [1], "gpus_per_node": 1}
    data["server"] = {**data.get("server", {}), "port": 8100}
    data["proxy"] = {**data.get("proxy", {}), "listen": 8081}
    other.write_text(yaml.safe_dump(data))
    r = _fleet(
        tmp_path,
        [REPO / "deployments" / "2node-ray-pp2.yaml", other],
        "servers = [('gpu-a', {'ssh_hostname': '192.0.2.11', 'private_address': '10.10.0.11', 'deployments': "
        "['llama70b-2node']}),\n"
        "           ('gpu-b', {'ssh_hostname': '192.0.2.12', 'private_address': '10.10.0.12', 'deployments': "
        "['llama70b-2node', 'one']})]\n"
        "workers = [('gpu-b', {'ssh_hostname': '192.0.2.12', 'private_address': '10.10.0.12'})]\n",
    )
    assert r.returncode == 1 and "gpu-b: deployment llama70b-2node" in r.stderr and "owns every GPU" in r.stderr, (
        r.stderr
    )


@pytest.mark.parametrize(
    "changes,clash",
    [
        (
            {"monitoring": {"enabled": True, "prometheus_port": 8000}},
            "port 8000 is used by vLLM vllm-lab-tiny-0.service and by Prometheus",
        ),
        (
            {"monitoring": {"enabled": True, "node_exporter_port": 80}},
            "port 80 is used by nginx of lab-tiny (proxy.listen) and by node exporter",
        ),
        ({"monitoring": {"enabled": True}, "server": {"port": 9115}}, "by blackbox exporter"),
        ({"monitoring": {"enabled": True, "node_exporter_port": 9090}}, "port 9090 is used by node exporter"),
    ],
)
def test_every_listening_part_is_in_the_port_check(tmp_path, changes, clash):
    """Class 7: vLLM, nginx, Prometheus, node exporter and blackbox on one host (one spec)."""
    spec = _spec(tmp_path, **changes)
    r = _fleet(tmp_path, [spec], "servers = [('lab1', {'ssh_hostname': '192.0.2.11'})]\nmonitoring = ['lab1']\n")
    assert r.returncode == 1 and clash in r.stderr, r.stderr


def test_rays_fixed_ports_and_worker_range_are_in_the_port_check(tmp_path):
    """Class 7 across specs: a replica on Ray's client server port 10001 / inside the worker range."""
    from vllm_fleet.render.layout import LayoutError, build

    ray = _resolved(REPO / "deployments" / "lab-tiny-pp2.yaml")
    for port, what in ((10001, "Ray ray client server"), (10500, "Ray worker ports 10002-10999")):
        other = _resolved(
            _spec(tmp_path, name=f"p{port}", server={"port": port, "host": "0.0.0.0"}, proxy={"listen": 8081})
        )
        inv = {
            "lab1": {
                "address": "192.0.2.11",
                "groups": ["servers"],
                "data": {"private_address": "10.10.0.11", "deployments": ["lab-tiny-pp2", f"p{port}"]},
            },
            "lab2": {"address": "192.0.2.12", "groups": ["workers"], "data": {"private_address": "10.10.0.12"}},
        }
        with pytest.raises(LayoutError) as exc:
            build([ray, other], inv)
        assert f"lab1: port {port} is used by {what}" in str(exc.value), str(exc.value)


def test_two_monitored_deployments_on_one_host_say_how_to_fix(tmp_path):
    """Class 12: not "a bug in vllm-fleet's renderer" but the fix."""
    a = _spec(tmp_path, name="one", monitoring={"enabled": True})
    b = _spec(
        tmp_path,
        name="two",
        monitoring={"enabled": True},
        server={"port": 8100, "host": "0.0.0.0"},
        proxy={"listen": 8081},
    )
    r = _fleet(tmp_path, [a, b], "servers = [('lab1', {'ssh_hostname': '192.0.2.11'})]\nmonitoring = ['lab1']\n")
    assert r.returncode == 1 and "bug" not in r.stderr, r.stderr
    assert "lab1: deployments one, two both have monitoring.enabled" in r.stderr and "in one spec only" in r.stderr, (
        r.stderr
    )


def test_cpu_native_multi_node_is_a_spec_error():
    """Class 11: the renderer's ValueError used to be the message (a traceback)."""
    r = run_cli("validate", str(REPO / "tests" / "specs" / "invalid" / "cpu-multinode-native.yaml"))
    assert (
        r.returncode == 1
        and "Traceback" not in r.stderr
        and "parallel.backend" in r.stderr
        and "backend: ray" in r.stderr
    ), r.stderr


def _nft():
    import shutil

    return shutil.which("nft") or ("/usr/sbin/nft" if Path("/usr/sbin/nft").exists() else None)


@pytest.mark.skipif(_nft() is None, reason="nft is not installed (make host-deps: nftables)")
def test_firewall_sets_are_merged_so_nft_accepts_them(tmp_path):
    """Class 3: an allow list network holding a listed address (and 0.0.0.0/0) gave nft's
    "conflicting intervals"."""
    import subprocess

    inv = _write(
        tmp_path,
        "servers = [('gpu1', {'ssh_hostname': '192.0.2.10', 'vllm_api_firewall_allow': ['192.0.2.0/24', '127.0.0.1'],\n"
        "                    'ray_firewall_allow': ['0.0.0.0/0']})]\n"
        "proxy = [('lb', {'ssh_hostname': '192.0.2.20'})]\n",
    )
    out = tmp_path / "out"
    r = run_cli("render", str(_spec(tmp_path)), "--inventory", str(inv), "--out", str(out))
    assert r.returncode == 0, r.stderr
    rules = out / "gpu1" / "etc" / "vllm-fleet" / "api-firewall.nft"
    assert "192.0.2.0/24" in rules.read_text() and "192.0.2.20" not in rules.read_text()
    c = subprocess.run([_nft(), "-c", "-f", str(rules)], capture_output=True, text=True, timeout=60)
    assert c.returncode == 0, c.stderr + rules.read_text()


def _debian_nginx_t(tmp: Path, site: str, auth: str) -> "subprocess.CompletedProcess":
    """nginx -t of ``site`` under Debian's own /etc/nginx/nginx.conf (its stock hash sizes), the
    site where conf.d/*.conf would be."""
    import re
    import subprocess

    from vllm_fleet.render import files as render

    site = site.replace(render.NGINX_SECRET_DIR + "/", f"{tmp}/")
    for m in re.finditer(r"include (\S+);", site):
        Path(m.group(1)).write_text(auth)
    (tmp / "site.conf").write_text(site)
    conf = Path("/etc/nginx/nginx.conf").read_text()
    conf = conf.replace("include /etc/nginx/conf.d/*.conf;", f"include {tmp}/site.conf;").replace(
        "include /etc/nginx/sites-enabled/*;", ""
    )
    conf = re.sub(r"^pid .*$", f"pid {tmp}/nginx.pid;", conf, flags=re.M).replace("/var/log/nginx/", f"{tmp}/")
    (tmp / "nginx.conf").write_text(conf)
    return subprocess.run(
        ["nginx", "-t", "-q", "-p", "/usr/share/nginx/", "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(not Path("/etc/nginx/nginx.conf").is_file(), reason="Debian's nginx is not installed")
def test_a_40_character_name_passes_nginx_t_under_debians_stock_config(tmp_path):
    """Class 5: names of 25+ characters failed "could not build variables_hash"."""
    from vllm_fleet.render import files as render

    name = "a" + "b" * 39
    resolved = _resolved(_spec(tmp_path, name=name))
    site = render.render(resolved)["proxy"][render.NGINX_SITE.format(name=name)].content
    r = _debian_nginx_t(tmp_path, site, render.nginx_auth_content(resolved, "sk-test_Key-123"))
    assert r.returncode == 0, r.stderr


def _site_and_auth(tmp_path: Path, name: str, **changes) -> tuple[str, str, dict]:
    """The proxy's nginx site (its TLS certificate and key made where the site names them) and the
    real auth include, for lab-tiny named ``name`` plus ``changes``."""
    import subprocess

    from vllm_fleet.render import files as render

    resolved = _resolved(_spec(tmp_path, name=name, **changes))
    site = render.render(resolved)["proxy"][render.NGINX_SITE.format(name=name)].content
    if "ssl_certificate " in site:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=test",
                "-keyout",
                str(tmp_path / f"{name}.key"),
                "-out",
                str(tmp_path / f"{name}.crt"),
            ],
            check=True,
            capture_output=True,
        )
    return site, render.nginx_auth_content(resolved, "sk-test_Key-123"), resolved


LONGEST_NAME = "a" + "b" * 39  # the schema's pattern allows 40 characters
LONGEST_HEADER = "X" + "h" * 62 + "Z"  # proxy.routing.session_header: 64


@pytest.mark.skipif(not Path("/etc/nginx/nginx.conf").is_file(), reason="Debian's nginx is not installed")
@pytest.mark.parametrize(
    "routing",
    [
        {"replicas": {"per_host": 2}},  # auto: session for 2+ replicas (its map variable), no routing key given
        {
            "replicas": {"per_host": 2},
            "proxy": {
                "routing": {"policy": "session", "session_header": LONGEST_HEADER},
                "tls": {"enabled": True, "self_signed": True},
                "listen": 443,
            },
        },
        {"replicas": {"per_host": 2}, "proxy": {"routing": {"policy": "cache_aware"}}},
    ],
    ids=["auto-2-replicas", "session-tls-longest-header", "cache_aware"],
)
def test_every_nginx_name_fits_debians_stock_hashes_at_the_longest_name(tmp_path, routing):
    """Round 3, class 2: `$vllm_fleet_<name>_pool` failed "could not build variables_hash" from a
    31-character name. Every nginx name derived from a user's value (variables, upstreams, zones)
    is at most render.files.NGINX_NAME_MAX characters, and the site passes nginx -t under
    Debian's own nginx.conf (variables_hash_bucket_size 64)."""
    import re

    from vllm_fleet.render import files as render

    site, auth, _ = _site_and_auth(tmp_path, LONGEST_NAME, **routing)
    names = re.findall(r"^\s*(?:upstream|map \S+) \$?(\w+) \{", site, re.M) + re.findall(r"shared:(\w+):", site)
    names += re.findall(r"^map \S+ \$(\w+) \{", auth, re.M)
    r = _debian_nginx_t(tmp_path, site, auth)
    assert r.returncode == 0, r.stderr
    assert names and all(len(n) <= render.NGINX_NAME_MAX for n in names), names


def test_nginx_names_are_bounded_and_distinct():
    from vllm_fleet.render.files import NGINX_NAME_MAX, nginx_name

    assert nginx_name("vllm_fleet_", "lab-tiny", "_pool") == "vllm_fleet_lab_tiny_pool"  # short names read as before
    a, b = nginx_name("vllm_fleet_", "x" * 39 + "a", "_pool"), nginx_name("vllm_fleet_", "x" * 39 + "b", "_pool")
    assert a != b and len(a) == len(b) == NGINX_NAME_MAX and a.startswith("vllm_fleet_xxx") and a.endswith("_pool")
    assert all(len(nginx_name("vllm_fleet_", "n" * k, "_session")) <= NGINX_NAME_MAX for k in range(1, 300))


@pytest.mark.skipif(not Path("/etc/nginx/nginx.conf").is_file(), reason="Debian's nginx is not installed")
@pytest.mark.parametrize(
    "ref", [{"file": "/" + "/".join(["k" * 250] * 16) + "/key"}, {"env": "K" * 5000}], ids=["file-4k", "env-5k"]
)
def test_a_long_secret_reference_stays_out_of_the_nginx_auth_include(tmp_path, ref):
    """Round 3, class 3: the auth include echoed server.api_key.file in a comment; a legal path of
    ~4,050 characters made nginx -t fail ("too long parameter"). The include names the kind of
    reference only, in the placeholder render writes and in the file the deploy writes."""
    from vllm_fleet.render import files as render

    site, auth, resolved = _site_and_auth(tmp_path, "lab-tiny", server={"api_key": ref})
    value = ref.get("file") or ref.get("env")
    assert len(value) > 4000
    placeholder = render.render(resolved)["proxy"][f"{render.NGINX_SECRET_DIR}/lab-tiny-auth.conf"].content
    for text in (auth, placeholder):
        r = _debian_nginx_t(tmp_path, site, text)
        assert r.returncode == 0, r.stderr
        assert value not in text and max(map(len, text.splitlines())) < 200


# ---------------------------------------------------------------------------------------------
# Command-line numbers (classes 14-17): refused by argparse (exit 2, usage) before any host

BAD_ARGS = [
    ["bench", "INV", "--concurrency", "abc"],
    ["bench", "INV", "--concurrency", "1,,2"],
    ["bench", "INV", "--concurrency", "1e3"],
    ["bench", "INV", "--concurrency", "0,-1"],
    ["bench", "INV", "--rate", "abc"],
    ["bench", "INV", "--rate", "-1"],
    ["bench", "INV", "--rate", "nan"],
    ["bench", "INV", "--rate", "inf"],
    ["bench", "INV", "--input-len", "-5"],
    ["bench", "INV", "--output-len", "0"],
    ["bench", "INV", "--prompts-per-level", "-1"],
    ["bench", "INV", "--min-prompts", "0"],
    ["tune", "INV", "--target", "ttft_p99_ms=nan"],
    ["tune", "INV", "--target", "ttft_p99_ms=inf"],
    ["tune", "INV", "--target", "ttft_p99_ms=1e400"],
    ["tune", "INV", "--target", "ttft_p99_ms=500,ttft_p99_ms=50"],
    ["tune", "INV", "--target", "ttft_p99_ms=500", "--budget", "-1"],
    ["tune", "INV", "--target", "ttft_p99_ms=500", "--budget", "nan"],
    ["tune", "INV", "--target", "ttft_p99_ms=500", "--input-len", "-1"],
    ["tune", "INV", "--target", "ttft_p99_ms=500", "--max-load", "-1"],
    ["tune", "INV", "--target", "ttft_p99_ms=500", "--max-probes", "0"],
    ["rollout", "INV", "--drain-timeout", "-1"],
    ["rollout", "INV", "--drain-timeout", "nan"],
    ["rollout", "INV", "--drain-timeout", "inf"],
    ["rollout", "INV", "--drain-timeout", "86401"],
    ["rollout", "INV", "--batch-size", "0"],
    ["rollout", "INV", "--batch-percent", "101"],
    ["init", ""],
]


@pytest.mark.parametrize("argv", BAD_ARGS, ids=lambda a: " ".join(a[2:]) or "init-empty")
def test_bad_numbers_are_usage_errors_before_any_host(tmp_path, argv, capsys, monkeypatch):
    """The inventory holds a host that must not be contacted: with the check first, it never is
    (the test's inventory file is never even read: it raises if it is)."""
    from vllm_fleet.commands.cli import main

    inv = _write(tmp_path, "raise RuntimeError('the inventory was read: the numbers were not checked first')\n")
    monkeypatch.chdir(tmp_path)
    try:
        rc = main([str(inv) if a == "INV" else a for a in argv])
    except SystemExit as exc:  # argparse's own exit, as the console script exits
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "usage:" in err and "Traceback" not in err and "inventory was read" not in err, (rc, err)
    assert not list(tmp_path.glob("*.yaml"))  # init "" wrote nothing here


def test_init_into_an_unwritable_place_is_a_message(tmp_path):
    r = run_cli("init", "/proc/vllm-fleet-x")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "cannot write /proc/vllm-fleet-x" in r.stderr, r.stderr


def test_good_numbers_still_parse():
    from vllm_fleet.commands.cli import build_parser

    a = build_parser().parse_args(["bench", "inv.py", "--concurrency", "1,4,16", "--input-len", "64"])
    assert a.concurrency == [1, 4, 16] and a.input_len == 64
    a = build_parser().parse_args(["tune", "inv.py", "--target", "ttft_p99_ms=500,tpot_p99_ms=50", "--budget", "30"])
    assert a.target == {"ttft_p99_ms": 500.0, "tpot_p99_ms": 50.0} and a.budget == 30.0
    assert build_parser().parse_args(["rollout", "inv.py", "--drain-timeout", "0"]).drain_timeout == 0.0


def test_a_broken_verb_module_is_an_import_error_not_an_invalid_choice():
    """cli.py imports every verb module plainly: a deploy module that fails to import must show
    its ImportError, not turn `deploy` into "invalid choice" (the --help test alone passed that)."""
    import subprocess
    import sys

    code = (
        "import importlib.abc, sys\n"
        "class Broken(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'vllm_fleet.commands.deploy':\n"
        "            raise ImportError('deploy is broken on purpose')\n"
        "sys.meta_path.insert(0, Broken())\n"
        "from vllm_fleet.commands.cli import main\n"
        "sys.exit(main(['deploy', 'inv.py']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 and "deploy is broken on purpose" in r.stderr and "invalid choice" not in r.stderr, (
        r.stderr
    )
