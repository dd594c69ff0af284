"""The CPU tier of the KV cache (engine.kv_offload, issue 37; docs/kv-offload.md): the spec key
and its checks, the flags against each vLLM release's own --help (captured in tests/fixtures),
the planner's figures, the host-memory check against RAM read by host_state.sh for real, `auto`,
the unit's memory limits, and a failed start's root cause found in a real vLLM journal."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest

from vllm_fleet.host.state import HostState, Query, Snapshot
from vllm_fleet.render import command
from vllm_fleet.render.files import build
from vllm_fleet.roles.common import clash
from vllm_fleet.roles.service.rootcause import failure_text, root_cause
from vllm_fleet.specs import load as spec
from vllm_fleet.specs import planner
from vllm_fleet.specs.checks import spec_problems

REPO = Path(__file__).resolve().parent.parent
FIX = Path(__file__).resolve().parent / "fixtures"
SPEC = REPO / "deployments" / "h200-kv-offload.yaml"
UNIT = "/etc/systemd/system/vllm-h200-kv-offload-0.service"
INV = {"g1": {"address": "10.0.0.1", "groups": ["servers"], "data": {}}}


def resolved(size=40, version="0.20.2", **engine) -> dict:
    r = spec.resolve(spec.load(SPEC))
    r["engine"]["kv_offload"]["size_gib"] = size
    r["install"]["vllm_version"] = version
    r["engine"].update(engine)
    return r


def unit_text(r: dict, data: dict | None = None) -> str:
    inv = copy.deepcopy(INV)
    inv["g1"]["data"].update(data or {})
    return build([r], inv).hosts["g1"].files[UNIT].content


def exec_start(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("ExecStart="))


def help_flags(version: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", (FIX / f"vllm-{version}-serve-help.txt").read_text()))


# ---- the spec key -----------------------------------------------------------------------------


def test_off_by_default_and_the_defaults_come_from_the_schema():
    r = spec.resolve(spec.load(REPO / "deployments" / "h200-qwen7b-awq.yaml"))
    assert r["engine"]["kv_offload"] == {"size_gib": 0, "backend": "native"}
    assert not [a for a in command.vllm_argv(r) if "offload" in a or "hybrid" in a]
    assert resolved(40)["engine"]["kv_offload"] == {"size_gib": 40, "backend": "native"}


@pytest.mark.parametrize(
    "value,ok", [(40, True), (0.5, True), ("auto", True), (0, True), (-1, False), ("big", False), (70000, False)]
)
def test_size_is_gib_or_auto(tmp_path, value, ok):
    text = SPEC.read_text().replace("kv_offload: {size_gib: 40}", f"kv_offload: {{size_gib: {value}}}")
    p = tmp_path / "s.yaml"
    p.write_text(text)
    problems = spec.schema_problems(spec.load(p))
    assert (not problems) is ok, problems
    if not ok:
        assert problems[0].path == "engine.kv_offload.size_gib"


def test_refused_on_the_cpu_build_and_without_prefix_caching():
    lab = spec.resolve(spec.load(REPO / "deployments" / "lab-tiny.yaml"))
    lab["engine"]["kv_offload"]["size_gib"] = 2
    assert [p.path for p in spec_problems(lab) if p.severity == "error"] == ["engine.kv_offload.size_gib"]
    assert not [p for p in spec_problems(resolved(40)) if p.path.startswith("engine.kv_offload")]
    off = resolved(40, enable_prefix_caching=False)
    assert [p.message for p in spec_problems(off) if p.path == "engine.kv_offload.size_gib"] == [
        "the tier keeps prefixes for later prefix-cache hits, and prefix caching is off"
    ]


def test_the_flags_are_owned_by_the_spec_key():
    r = resolved(0)
    r["engine"]["extra_args"] = ["--kv-offloading-size", "40", "--disable-hybrid-kv-cache-manager"]
    owned = {p.path: p.message for p in spec_problems(r)}
    assert "engine.kv_offload.size_gib" in owned["engine.extra_args[0]"]
    assert "engine.kv_offload" in owned["engine.extra_args[2]"]


# ---- the command line, against each release's own --help -----------------------------------------


def test_releases_before_0_21_get_the_hybrid_manager_switched_off():
    """vLLM 0.20.2 refuses the offloading connector beside the hybrid KV cache manager (measured on
    the H200): the flag is rendered there, and not on 0.21 and later, whose connector supports it."""
    old = exec_start(unit_text(resolved(40, "0.20.2")))
    assert "--kv-offloading-size 40 --kv-offloading-backend native --disable-hybrid-kv-cache-manager" in old
    for v in ("0.21.0", "0.32.0", "0.33.0"):
        new = exec_start(unit_text(resolved(40, v)))
        assert "--kv-offloading-size 40 --kv-offloading-backend native" in new and "hybrid" not in new, v
    assert "--kv-offloading" not in exec_start(unit_text(resolved(0)))


@pytest.mark.parametrize("version", ["0.20.2", "0.32.0"])
def test_every_rendered_flag_is_in_that_releases_help(version):
    """vllm serve --help of 0.20.2 (its wheel's own parser) and 0.32.0 (the CPU build's), captured
    in tests/fixtures: every flag of the rendered command line is there."""
    argv = command.vllm_argv(resolved(40, version))
    flags = [a for a in argv if a.startswith("--")]
    assert {"--kv-offloading-size", "--kv-offloading-backend"} <= set(flags)
    known = help_flags(version)
    assert len(known) > 150
    assert not [f for f in flags if f not in known]
    assert ("--disable-hybrid-kv-cache-manager" in flags) is (version == "0.20.2")
    assert "native" in re.search(
        r"--kv-offloading-backend \{([^}]*)\}", (FIX / f"vllm-{version}-serve-help.txt").read_text()
    ).group(1)


def test_host_data_gives_a_hosts_figure_and_auto_renders_no_tier_until_known():
    assert "--kv-offloading-size 12 " in exec_start(unit_text(resolved(40), {"kv_offload_gib": 12}))
    assert "--kv-offloading-size 31 " in exec_start(
        unit_text(resolved("auto"), {"kv_offload_gib": {"h200-kv-offload": 31}})
    )
    assert "--kv-offloading" not in exec_start(unit_text(resolved("auto")))  # render without the host's memory
    assert "--kv-offloading" not in exec_start(
        unit_text(resolved(0), {"kv_offload_gib": 12})
    )  # no tier: host data alone adds none


def test_the_unit_lets_vllm_pin_host_memory():
    """Pinned host memory needs RLIMIT_MEMLOCK; no memory cap may cut the tier."""
    lines = unit_text(resolved(40)).splitlines()
    assert "LimitMEMLOCK=infinity" in lines
    assert not [
        line for line in lines if line.startswith(("MemoryMax=", "MemoryHigh=", "MemoryLimit=", "MemorySwapMax="))
    ]


# ---- the planner --------------------------------------------------------------------------------


def test_plan_shows_the_tier_in_gib_and_tokens():
    p = planner.plan(resolved(40))
    assert p["kv_bytes_per_token"] == 57344  # 2 x 28 layers x 4 KV heads x 128 x 2 bytes
    assert p["kv_offload_gib"] == 40 and p["kv_offload_tokens"] == 40 * 1024**3 // 57344 == 748982
    assert p["kv_tokens"] == 181296
    text = planner.format_plan(p)
    assert "CPU KV tier / replica  40.00 GiB = 748,982 tokens in host RAM" in text
    assert "52 GiB of host RAM" in text  # 8 reserve + 1 x (4 + 40)
    assert planner.plan(resolved("auto"))["kv_offload_tokens"] is None
    assert "auto (sized per host at deploy)" in planner.format_plan(planner.plan(resolved("auto")))
    assert planner.plan(resolved(0))["kv_offload_gib"] is None


def test_host_memory_arithmetic():
    gib = 1024**3
    fig = planner.host_memory(128 * gib, [("a", 40), ("b", 40)])
    assert fig == {
        "total_gib": 128,
        "reserve_gib": 16,
        "fixed_gib": 80,
        "left_gib": 32,
        "auto_gib": None,
        "replicas": 2,
        "fits": True,
    }
    assert not planner.host_memory(128 * gib, [("a", 60), ("b", 60)])["fits"]  # 16 + 120 > 128
    auto = planner.host_memory(128 * gib, [("a", "auto"), ("b", "auto"), ("c", None), ("d", 20)])
    assert auto["reserve_gib"] == 24 and auto["auto_gib"] == 42 and auto["fits"]  # (128 - 24 - 20) / 2
    assert planner.host_memory(16 * gib, [("a", "auto")])["auto_gib"] == 4  # 16 - 8 - 4
    assert planner.host_memory(12.5 * gib, [("a", "auto")])["fits"] is False  # 0.5 GiB left: under 1


# ---- the check against the host's RAM, read for real ------------------------------------------------


def _read(query: Query) -> Snapshot:
    import subprocess

    cmd = HostState().command(query).get_raw_value()
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    s = Snapshot.parse(r.stdout.splitlines())
    s.query = query
    return s


def _host(r: dict, data: dict | None = None):
    inv = copy.deepcopy(INV)
    inv["g1"]["data"].update(data or {})
    return build([r], inv).hosts["g1"]


def _snap_with_units(units: dict[str, str]) -> Snapshot:
    """This machine's /proc/meminfo read by host_state.sh, plus a scripted glob of other units."""
    import base64

    snap = _read(Query(read=(clash.MEMINFO,)))
    lines = [f"glob\t{clash.UNITS}\t."] + [
        f"glob\t{clash.UNITS}\t{p}\t{base64.b64encode(t.encode()).decode()}" for p, t in units.items()
    ]
    other = Snapshot.parse([*lines, "end"])
    other.query = Query(globs=(clash.UNITS,))
    snap.merge(other)
    return snap


def test_the_one_read_asks_meminfo_only_where_a_tier_is_planned():
    assert clash.memory_query({"h200-kv-offload": resolved(40)}, _host(resolved(40))).read == (clash.MEMINFO,)
    assert not clash.memory_query({"h200-kv-offload": resolved(0)}, _host(resolved(0)))


def test_memtotal_is_the_machines_ram():
    """MemTotal as host_state.sh read it = the kernel's physical pages (sysconf), an independent reader."""
    snap = _read(Query(read=(clash.MEMINFO,)))
    assert clash.mem_total(snap.content(clash.MEMINFO)[1]) == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_tier_too_big_for_this_machine_is_refused_with_the_numbers_and_the_largest_that_fits():
    from pyinfra.api.exceptions import DeployError

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3
    r = resolved(60000)
    h, specs = _host(r), {r["name"]: r}
    snap = _snap_with_units({})
    largest = int(total - 12)  # 8 GiB reserve + 4 GiB for the one replica
    with pytest.raises(DeployError) as exc:
        clash.refuse_memory(specs, h, "g1", snap)
    text = str(exc.value)
    assert text.startswith(
        f"host g1: the CPU tiers of the KV cache do not fit in its memory: {round(total, 2):g} GiB of RAM (MemTotal) "
        "- reserve 12 GiB (8 + 4 x 1 vLLM replicas) - tiers vllm-h200-kv-offload-0.service 60000 GiB"
    )
    assert (
        f"the largest engine.kv_offload.size_gib of h200-kv-offload that fits here (1 replica(s)): {largest} GiB (or "
        "`auto`)" in text
    )
    assert text.endswith("nothing was uploaded or changed")
    # the largest that fits does fit; one GiB more does not (unless the rounding gave slack)
    assert clash.refuse_memory({r["name"]: resolved(largest)}, _host(resolved(largest)), "g1", snap) == {}
    assert clash.memory_plan({r["name"]: resolved(largest + 1)}, _host(resolved(largest + 1)), snap)[1]


def test_other_deployments_tiers_on_the_host_count_and_auto_takes_what_is_left():
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3
    other = {
        "/etc/systemd/system/vllm-old-0.service": "ExecStart=/x/vllm serve m --kv-offloading-size 3 --port 9000\n",
        "/etc/systemd/system/vllm-old-1.service": "ExecStart=/x/vllm serve m --port 9001\n",
    }
    snap = _snap_with_units(other)
    r = resolved("auto")
    fig, lines, auto = clash.memory_plan({r["name"]: r}, _host(r), snap)
    if total < 8 + 3 * 4 + 3 + 1:  # a machine too small for this arithmetic: refused instead
        assert lines
        return
    assert not lines and fig["replicas"] == 3 and fig["reserve_gib"] == 20 and fig["fixed_gib"] == 3
    assert auto == {"h200-kv-offload": int((total - 20 - 3) // 1)}
    # the figure reaches the unit through host data, as the deploy puts it (deploys/serve.py)
    assert f"--kv-offloading-size {auto['h200-kv-offload']} " in exec_start(unit_text(r, {"kv_offload_gib": auto}))
    # a unit of ours (a redeploy) is not counted as another deployment's
    mine = {
        "/etc/systemd/system/vllm-h200-kv-offload-0.service": "ExecStart=/x/vllm serve m --kv-offloading-size 3000\n"
    }
    assert clash.memory_plan({r["name"]: r}, _host(r), _snap_with_units(mine))[2] == {
        "h200-kv-offload": int(total - 12)
    }


def test_nothing_is_judged_without_a_read():
    r = resolved(60000)
    assert clash.memory_plan({r["name"]: r}, _host(r), Snapshot()) == (None, [], {})


# ---- a failed start names its root cause ------------------------------------------------------------


def test_root_cause_of_a_real_failed_start():
    """vLLM 0.32.0 (CPU build) started with `--num-gpu-blocks-override 1` on the tiny model: the
    engine's ValueError, not the API server's 'see root cause above'."""
    lines = (FIX / "vllm-0.32.0-engine-start-failure.log").read_text().splitlines()
    assert [
        line
        for line in lines[-5:]
        if line.startswith("RuntimeError: Engine core initialization failed. See root cause above")
    ]
    assert root_cause(lines) == (
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its "
        "name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
    text = failure_text("g1", "vllm-x-0.service", "not healthy after 40 s.", lines, 10)
    head = text.splitlines()
    assert head[1] == "  root cause: " + root_cause(lines)
    assert head[2] == "  full journal: journalctl -u vllm-x-0.service --no-pager (on g1)"
    assert head[3] == "Last 10 journal lines:" and head[-1] == lines[-1]


def test_root_cause_above_a_long_api_server_traceback():
    """The issue's case: the engine's line above 60 lines of the API server's traceback."""
    eng = "(EngineCore_DP0 pid=812) ERROR 12-04 01:02:03 [core.py:708]"
    lines = [
        f"{eng} EngineCore failed to start.",
        f"{eng} Traceback (most recent call last):",
        f'{eng}   File "/x/vllm/v1/engine/core.py", line 699, in run_engine_core',
        f"{eng} ValueError: Connector OffloadingConnector does not support HMA but HMA is enabled. Please set "
        "`--disable-hybrid-kv-cache-manager`.",
        "(APIServer pid=700) Traceback (most recent call last):",
    ]
    lines += [f'(APIServer pid=700)   File "/x/y{i}.py", line {i}, in f' for i in range(80)]
    lines += [
        "(APIServer pid=700) RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {}"
    ]
    assert root_cause(lines) == (
        "ValueError: Connector OffloadingConnector does not support HMA but HMA is enabled. "
        "Please set `--disable-hybrid-kv-cache-manager`."
    )
    assert "OffloadingConnector" not in "\n".join(lines[-60:])  # the old tail never showed it
    assert (
        root_cause(["Started vllm.", "OSError: [Errno 98] Address already in use"])
        == "OSError: [Errno 98] Address already in use"
    )
    assert root_cause(["Started vllm.", "INFO all good"]) is None


def test_without_the_engine_block_the_api_servers_pointer_is_never_the_cause():
    """A journal whose `EngineCore failed to start` line was cut off: the last exception line
    that is not the API server's "see root cause above"."""
    lines = [
        "(EngineCore_DP0 pid=9) ERROR 12-04 01:02:03 [core.py:708] torch.OutOfMemoryError: CUDA out of memory. Tried "
        "to allocate 2.00 GiB",
        "(APIServer pid=7) ERROR 12-04 01:02:04 [api_server.py:1] RuntimeError: Engine core initialization failed. "
        "See root cause above. Failed core proc(s): {}",
    ]
    assert root_cause(lines) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_auto_is_sized_from_this_machines_ram_and_the_hosts_units_rendered_with_it():
    """What deploys/serve.py and the rollout's update step do after the one state read
    (roles.common.settle_memory): `auto` from MemTotal - reserve, put into the host's data and
    this host's layout built again; a fixed size that fits leaves the layout as it was."""
    from vllm_fleet.roles.common import DeployContext, settle_memory

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3
    r = resolved("auto")
    inv = copy.deepcopy(INV)
    ctx = DeployContext(
        build([r], inv), {r["name"]: r}, {r["name"]: {}}, {r["name"]: str(SPEC)}, str(SPEC), inventory=inv
    )
    h = ctx.layout.hosts["g1"]
    assert "--kv-offloading" not in exec_start(h.files[UNIT].content)
    snap = _snap_with_units({})
    h2 = settle_memory(ctx, h, "g1", snap)
    want = int(round(total, 2) - 12)
    assert (
        f"--kv-offloading-size {want} --kv-offloading-backend native --disable-hybrid-kv-cache-manager"
        in exec_start(h2.files[UNIT].content)
    )
    assert ctx.layout.hosts["g1"] is h2 and inv["g1"]["data"]["kv_offload_gib"] == {"h200-kv-offload": want}
    fixed = resolved(2)
    ctx2 = DeployContext(
        build([fixed], copy.deepcopy(INV)),
        {fixed["name"]: fixed},
        {fixed["name"]: {}},
        {fixed["name"]: str(SPEC)},
        str(SPEC),
        inventory=copy.deepcopy(INV),
    )
    h3 = ctx2.layout.hosts["g1"]
    assert settle_memory(ctx2, h3, "g1", snap) is h3


def test_diff_renders_an_auto_host_as_the_deploy_does(monkeypatch):
    """`vllm-fleet diff` on an `auto` host: its read asks the memory too, and the expected unit
    carries the figure the deploy gives it (host_state.sh run here for real, as the host)."""
    from vllm_fleet.commands import diff
    from vllm_fleet.commands.deploy import Deployment
    from vllm_fleet.render.files import render

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3
    r = resolved("auto")
    inv = copy.deepcopy(INV)
    d = Deployment(str(SPEC), r, SPEC.parent, ["g1"], inv, render(r, inv))
    asked = []

    def read_host(name, address, data, query):
        asked.append(query)
        return _read(query)

    monkeypatch.setattr(diff, "read_host", read_host)
    [hd] = diff.diff_files([d])
    assert clash.MEMINFO in asked[0].read and clash.UNITS in asked[0].globs
    unit = next(f for f in hd.files if f.path == UNIT)
    assert f"--kv-offloading-size {int(round(total, 2) - 12)} " in unit.diff, unit.diff[-500:]
    d40 = Deployment(str(SPEC), resolved(40), SPEC.parent, ["g1"], inv, render(resolved(40), inv))
    [hd40] = diff.diff_files([d40])
    assert clash.MEMINFO not in asked[-1].read  # a number: nothing more to read
    assert "--kv-offloading-size 40 " in next(f for f in hd40.files if f.path == UNIT).diff
