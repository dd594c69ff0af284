"""Every inventory pyinfra takes, read by the one reader (vllm_fleet.specs.inventory.load_inventory):
a .py file, ``@local``, ``@ssh/HOST``, ``user@host[:port]``, comma-separated lists, with ``--data``;
every command that reaches hosts takes them; ``@local`` goes through a child process of this one
(never SSH to 127.0.0.1, never pyinfra's gevent child watcher from a thread)."""

from __future__ import annotations

import pytest

from fleetutil import REPO, run_cli
from vllm_fleet.specs.inventory import InventoryError, is_inline, load_inventory

SPEC = REPO / "deployments" / "lab-tiny.yaml"


def test_at_local_is_this_machine_in_the_servers_group():
    hosts = load_inventory("@local", [f"vllm_fleet_spec={SPEC}"])
    assert list(hosts) == ["@local"]
    h = hosts["@local"]
    assert h["address"] == "127.0.0.1" and "servers" in h["groups"] and h["order"]["servers"] == 0
    assert h["data"]["vllm_fleet_spec"] == str(SPEC)


def test_user_at_host_gives_the_login_and_the_address():
    hosts = load_inventory("lab@10.10.0.12:2222")
    h = hosts["lab@10.10.0.12:2222"]
    assert h["address"] == "10.10.0.12" and h["groups"] == ["servers"]
    assert h["data"]["ssh_user"] == "lab" and h["data"]["ssh_port"] == 2222
    # --data says more than the name (pyinfra's precedence: --data is the highest)
    h = load_inventory("lab@10.10.0.12", ["ssh_user=root"])["lab@10.10.0.12"]
    assert h["data"]["ssh_user"] == "root" and "ssh_port" not in h["data"]


def test_a_comma_list_keeps_its_order_and_ssh_connector_hosts_their_address():
    hosts = load_inventory("@ssh/10.10.0.13,10.10.0.11,lab@10.10.0.12")
    assert list(hosts) == ["@ssh/10.10.0.13", "10.10.0.11", "lab@10.10.0.12"]
    assert [h["address"] for h in hosts.values()] == ["10.10.0.13", "10.10.0.11", "10.10.0.12"]
    assert [h["order"]["servers"] for h in hosts.values()] == [0, 1, 2]


def test_a_file_inventory_is_read_as_before(tmp_path):
    """Hosts of a file keep the file's groups: one outside `servers` is not made a server."""
    inv = tmp_path / "inv.py"
    inv.write_text(
        "servers = [('a', {'ssh_hostname': '192.0.2.1'})]\nmonitoring = [('m', {'ssh_hostname': '192.0.2.2'})]\n"
    )
    hosts = load_inventory(str(inv))
    assert "servers" in hosts["a"]["groups"] and "servers" not in hosts["m"]["groups"], hosts


@pytest.mark.parametrize("text", ["inventory", "inventory.py", "hosts/lab.py", "", "  "])
def test_a_lone_word_or_a_missing_file_is_no_such_file(text):
    assert not is_inline(text)
    with pytest.raises(InventoryError) as exc:
        load_inventory(text)
    assert "no such file" in str(exc.value) and "@local" in str(exc.value)


def test_the_deploys_read_of_pyinfra_hosts_gives_the_same_groups():
    """roles.common.inventory_hosts goes through render_entry with pyinfra's host.groups: an
    inline host (only connector groups, or none) is a server there too; a file's host is not changed."""
    from vllm_fleet.render.layout import render_entry

    assert "servers" in render_entry("@local", ["@local", "@local"], {})["groups"]
    assert render_entry("lab@10.10.0.12", [], {})["groups"] == ["servers"]
    assert render_entry("lab@10.10.0.12", [], {})["address"] == "10.10.0.12"
    assert render_entry("m", ["monitoring", "inv"], {})["groups"] == ["monitoring", "inv"]


def test_host_data_of_an_inline_inventory_is_checked_as_strictly():
    from vllm_fleet.render.layout import LayoutError, build
    from vllm_fleet.specs.load import load_and_check

    resolved, _ = load_and_check(str(SPEC))
    with pytest.raises(LayoutError) as exc:
        build([resolved], load_inventory("@local", ["private_address=300.1.2.3", "replicas_per_host=two"]))
    text = str(exc.value)
    assert (
        "host @local: data private_address = '300.1.2.3'" in text
        and "host @local: data replicas_per_host = 'two'" in text
    ), text
    lay = build([resolved], load_inventory("@local"))
    assert [i.id for i in lay.instances(resolved["name"])] == ["@local:0"]
    assert lay.hosts_with("proxy", resolved["name"]) == ["@local"]


def test_sudo_follows_the_data_then_the_login():
    from vllm_fleet.host.transport import needs_sudo

    assert not needs_sudo({}, "@local") and needs_sudo({"_sudo": True}, "@local")
    assert needs_sudo({}, "lab@10.10.0.12") and not needs_sudo({}, "root@10.10.0.12")
    assert needs_sudo({"ssh_user": "lab"}, "10.10.0.12") and not needs_sudo(
        {"ssh_user": "lab", "_sudo": False}, "10.10.0.12"
    )
    assert not needs_sudo({}, "10.10.0.12")


def test_at_local_runs_here_from_every_thread_of_map():
    """Transport.map runs each host in a thread: @local through pyinfra's local connector there
    was "TypeError: child watchers are only available on the default loop" (vllm-fleet status)."""
    import os

    from vllm_fleet.host.programs import argv
    from vllm_fleet.host.transport import Transport

    with Transport({"@local": {"address": "127.0.0.1", "data": {}}}) as t:
        rows = t.map(
            lambda n: t.run(n, argv("sh", "-c", "echo $(cut -d' ' -f4 /proc/$PPID/stat); exit 3")), ["@local"] * 3
        )
    for r in rows:
        assert r.code == 3 and not r.ok, r
        # sh -c LINE, a child of this process, ran it: no SSH, no other connector
        assert int(r.stdout) == os.getpid(), r


@pytest.mark.parametrize(
    "argv",
    [
        ["deploy", "@local", "--data", "private_address=300.1.2.3", "-y"],
        ["down", "@local", "--data", "private_address=300.1.2.3", "-y"],
        ["diff", "@local", "--data", "private_address=300.1.2.3"],
        ["status", "@local", "--data", "private_address=300.1.2.3"],
        ["bench", "@local", "--data", "private_address=300.1.2.3"],
        ["tune", "@local", "--data", "private_address=300.1.2.3", "--target", "ttft_p99_ms=500", "--dry"],
        ["rollout", "@local", "--data", "private_address=300.1.2.3", "--dry"],
    ],
)
def test_every_command_takes_an_inline_inventory_and_its_data(argv):
    """Each command reads `@local` with --data through the one reader, and refuses the bad host
    data there: exit 1 (diff: 2, its "could not tell") naming host and key, no host contacted, no traceback."""
    r = run_cli(*argv, "--spec", str(SPEC))
    assert r.returncode == (2 if argv[0] == "diff" else 1), (argv, r.returncode, r.stdout, r.stderr)
    assert "host @local: data private_address = '300.1.2.3'" in r.stderr, (argv, r.stderr)
    assert "Traceback" not in r.stderr and "no such file" not in r.stderr


def test_diff_reads_at_local_here_not_over_ssh_to_its_address(capsys):
    """`vllm-fleet diff @local` reads this machine through the one transport by the host's name
    (it used to open SSH to 127.0.0.1:22 and end "cannot read the host", exit 2)."""
    from vllm_fleet.commands import diff as diffmod

    rc = diffmod.run("@local", str(SPEC), files_only=True)
    out = capsys.readouterr()
    assert "cannot read the host" not in out.out + out.err and rc in (0, 1), (rc, out.out[-2000:], out.err[-2000:])
    assert "== @local (lab-tiny)" in out.out, out.out[:2000]


def _render_local(spec: dict, inventory: str = "@local") -> dict:
    from vllm_fleet.render import files
    from vllm_fleet.render.layout import render_entry
    from vllm_fleet.specs.load import load_and_check

    import yaml, tempfile, os

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=SPEC.parent, delete=False) as f:
        yaml.safe_dump(spec, f)
    try:
        resolved, _ = load_and_check(f.name)
    finally:
        os.unlink(f.name)
    inv = {n: render_entry(n, h["groups"], h["data"]) for n, h in load_inventory(inventory).items()}
    return files.render(resolved, inv)


def _nginx_listen(rendered: dict, host: str) -> list[str]:
    site = rendered[host]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    return [ln.split()[1] for ln in site.splitlines() if ln.strip().startswith("listen ")]


def test_the_workstation_serves_its_user_nginx_on_loopback_vllm_behind_it_no_firewall():
    """@local (the machine under the desk): nginx listens on 127.0.0.1 unless proxy.bind says
    otherwise, vLLM binds 127.0.0.1 behind it, and so no nftables table is written (none that
    could cut the user's SSH or desktop sessions). A server (user@host) keeps every address."""
    import yaml

    spec = yaml.safe_load(SPEC.read_text())
    here = _render_local(spec)
    assert _nginx_listen(here, "@local") == ["127.0.0.1:80"]
    unit = here["@local"]["/etc/systemd/system/vllm-lab-tiny-0.service"].content
    assert "--host 127.0.0.1 " in unit
    assert not [p for p in here["@local"] if "nft" in p or "firewall" in p], sorted(here["@local"])
    assert _nginx_listen(_render_local(spec, "lab@10.10.0.12"), "lab@10.10.0.12") == ["80"]
    spec["proxy"]["bind"] = "0.0.0.0"  # the spec says otherwise: the network too, as on a server
    assert _nginx_listen(_render_local(spec), "@local") == ["80"]
    spec["proxy"]["bind"] = "10.10.0.11"
    assert _nginx_listen(_render_local(spec), "@local") == ["10.10.0.11:80"]


def test_one_machine_renders_the_same_files_under_either_name():
    """lab1 read through `@local` on itself and through `lab@10.10.0.11` from the control machine
    (proxy.bind 0.0.0.0, as lab1 serves the lab's network): every file byte for byte the same, so
    `vllm-fleet diff @local` after a deploy from the control machine exits 0 (node.env's comment
    named the host: 'Per-host environment (@local)' against '(lab1)', issue 38)."""
    import yaml

    spec = yaml.safe_load(SPEC.read_text())
    spec["proxy"]["bind"] = "0.0.0.0"
    here, there = _render_local(spec)["@local"], _render_local(spec, "lab@10.10.0.11")["lab@10.10.0.11"]
    assert sorted(here) == sorted(there)
    differ = [
        p
        for p in here
        if (here[p].content, here[p].mode, here[p].owner, here[p].group)
        != (there[p].content, there[p].mode, there[p].owner, there[p].group)
    ]
    assert differ == [], differ


def test_init_local_writes_an_at_local_inventory_that_deploys_here(tmp_path):
    import os

    r = run_cli("init", "--local", str(tmp_path))
    assert r.returncode == 0 and f"vllm-fleet status {tmp_path / 'inventory.py'}" in r.stdout, r.stdout + r.stderr
    hosts = load_inventory(str(tmp_path / "inventory.py"))
    assert list(hosts) == ["@local"] and "servers" in hosts["@local"]["groups"]
    data = hosts["@local"]["data"]
    assert data["vllm_fleet_spec"] == str(tmp_path / "deployment.yaml") and data["_sudo"] is (os.geteuid() != 0)
    r = run_cli("validate", str(tmp_path / "deployment.yaml"), "--inventory", str(tmp_path / "inventory.py"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_desktops_own_default_site_stays_on_at_local_and_nginx_accepts_both(tmp_path):
    """On @local the distribution's default site is kept (a desktop's own nginx), and nginx -t
    accepts it beside vllm-fleet's site on 127.0.0.1 (the port alone would be a duplicate
    default_server: nginx -t fails, checked here too). A server still loses it by default."""
    import shutil
    import subprocess

    from vllm_fleet.roles.nginx import remove_default_site

    assert remove_default_site("@local", None) is False and remove_default_site("gpu1", None) is True
    assert remove_default_site("@local", True) is True and remove_default_site("gpu1", False) is False
    if not shutil.which("nginx"):
        pytest.skip("nginx not installed")
    debian_default = (
        "server { listen 80 default_server; listen [::]:80 default_server; root /var/www/html; server_name _; }"
    )
    for listen, ok in (("127.0.0.1:80", True), ("80", False)):
        conf = tmp_path / f"nginx-{ok}.conf"
        conf.write_text(
            f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;\nevents {{}}\nhttp {{ access_log off;\n"
            f"{debian_default}\nserver {{ listen {listen} default_server; server_name _; return 200; }}\n}}\n"
        )
        r = subprocess.run(["nginx", "-t", "-c", str(conf)], capture_output=True, text=True, timeout=60)
        assert (r.returncode == 0) is ok, (listen, r.stderr)


def test_pyinfra_gets_a_file_for_user_at_host_and_the_same_hosts_from_it(monkeypatch, tmp_path):
    """pyinfra 3's CLI looks `lab@10.10.0.12` up as a host name ("Could not resolve hostname",
    seen in the lab); the deploy's pyinfra gets a generated file that reads as the inline text does."""
    from vllm_fleet.commands.deploy import pyinfra_argv
    from vllm_fleet.specs.inventory import for_pyinfra

    monkeypatch.setenv("HOME", str(tmp_path))
    assert for_pyinfra("@local") == "@local" and for_pyinfra("@ssh/10.0.0.1,10.0.0.2") == "@ssh/10.0.0.1,10.0.0.2"
    text = "lab@10.10.0.12:2222,@local"
    path = pyinfra_argv(text, "x.y", [], [])[1]
    assert path.startswith(str(tmp_path)) and path.endswith(".py"), path
    inline, generated = load_inventory(text), load_inventory(path)
    assert list(inline) == list(generated)
    for name, h in inline.items():
        g = generated[name]
        assert (
            g["address"] == h["address"] and "servers" in g["groups"] and g["order"]["servers"] == h["order"]["servers"]
        )
        assert {k: v for k, v in g["data"].items() if k != "ssh_hostname"} == h["data"]
    assert generated["lab@10.10.0.12:2222"]["data"]["ssh_hostname"] == "10.10.0.12"


def test_the_deploys_layout_reaches_a_host_at_its_ssh_hostname_from_pyinfras_host_data():
    """The deploy builds its layout from pyinfra's hosts, whose data is a HostData (no Mapping): the
    address is still ssh_hostname, as `vllm-fleet render --inventory` gives it, so the client
    settings (openai.json) name an address clients can reach, not the inventory name."""
    from pyinfra.api import Inventory

    from vllm_fleet.render.layout import render_entry

    inv = Inventory(([("lab1", {"ssh_hostname": "10.10.0.11", "private_address": "10.10.0.11"})], {}))
    h = inv.get_host("lab1")
    assert render_entry(h.name, ["servers", "proxy"], h.data)["address"] == "10.10.0.11"
