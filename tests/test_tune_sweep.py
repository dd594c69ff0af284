"""vllm-fleet bench / tune without hosts: target and grid parsing, pruning (checks, planner,
duplicate command lines), the load search, the Pareto front, resume, the overlay (it validates
merged into the spec), the report files, and a whole sweep against a fake host session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_fleet.serving import report

from vllm_fleet.serving import tune
from vllm_fleet.specs.load import load, load_and_check

REPO = Path(__file__).resolve().parents[1]
RTX = REPO / "deployments" / "rtx3090-qwen7b-awq-realtime.yaml"
H200 = REPO / "deployments" / "h200-qwen7b-bf16.yaml"


def test_parse_target_and_grid():
    assert tune.parse_target("ttft_p99_ms=500, tpot_p99_ms=7.5") == {"ttft_p99_ms": 500.0, "tpot_p99_ms": 7.5}
    for bad in ("ttft=5", "ttft_p99_ms=fast", "ttft_p99_ms=0", ""):
        with pytest.raises(tune.TuneError):
            tune.parse_target(bad)
    g = tune.parse_grid(
        "max_num_seqs=8,16;enable_prefix_caching=true,false;max_num_batched_tokens=none,8192;gpu_memory_utilization=0.9"
    )
    assert g == {
        "max_num_seqs": [8, 16],
        "enable_prefix_caching": [True, False],
        "max_num_batched_tokens": [None, 8192],
        "gpu_memory_utilization": [0.9],
    }
    with pytest.raises(tune.TuneError, match="KEY one of"):
        tune.parse_grid("swap_space=4")


def test_meets_and_excess():
    t = {"ttft_p99_ms": 100, "tpot_p99_ms": 10}
    m = {"p99_ttft_ms": 90, "p99_tpot_ms": 9, "completed": 10, "failed": 0}
    assert tune.meets(m, t) and tune.excess(m, t) == pytest.approx(0.9)
    assert not tune.meets({**m, "failed": 1}, t)
    assert not tune.meets({**m, "p99_tpot_ms": 11}, t) and tune.excess({**m, "p99_tpot_ms": 11}, t) == pytest.approx(
        1.1
    )
    assert not tune.meets(None, t) and tune.excess(None, t) == float("inf")


def test_points_start_with_the_spec_and_never_repeat():
    base = {"max_num_seqs": 16, "enable_prefix_caching": True}
    pts = tune.points({"max_num_seqs": [8, 16], "enable_prefix_caching": [True, False]}, base)
    assert pts[0] == base and len(pts) == 4 and len({json.dumps(p, sort_keys=True) for p in pts}) == 4


def test_default_grid_follows_the_hardware():
    rtx, _ = load_and_check(RTX)
    g = tune.default_grid(rtx, {"compute_capability": 8.6})
    assert "kv_cache_dtype" not in g and "tensor" not in g and 16 in g["max_num_seqs"]
    assert tune.default_grid(rtx, {"compute_capability": 9.0})["kv_cache_dtype"] == ["auto", "fp8"]
    lab, _ = load_and_check(REPO / "deployments" / "lab-tiny.yaml")
    assert "gpu_memory_utilization" not in tune.default_grid(lab)  # the CPU build ignores it


def test_the_kv_caches_cpu_tier_is_swept_where_the_spec_has_one():
    """Issue 37: off and the spec's size in the default grid (kept only where it wins), a deeper
    key of the spec (engine.kv_offload.size_gib) read and overlaid; each point's command line
    differs by the tier's flags only."""
    kv = REPO / "deployments" / "h200-kv-offload.yaml"
    resolved, _ = load_and_check(kv)
    assert tune.default_grid(resolved, {"compute_capability": 9.0, "cuda_total_gib": 139.8})["kv_offload_gib"] == [
        0,
        40,
    ]
    assert "kv_offload_gib" not in tune.default_grid(
        load_and_check(H200)[0], {"compute_capability": 9.0}
    )  # no tier: none
    assert tune.base_settings(resolved, ["kv_offload_gib", "max_num_seqs"]) == {
        "kv_offload_gib": 40,
        "max_num_seqs": 64,
    }
    assert tune.overlay_of({"kv_offload_gib": 0, "max_num_seqs": 8}) == {
        "engine": {"kv_offload": {"size_gib": 0}, "max_num_seqs": 8}
    }
    assert tune.parse_grid("kv_offload_gib=0,20,40") == {"kv_offload_gib": [0, 20, 40]}
    pts = tune.prune(load(kv), [{"kv_offload_gib": 40}, {"kv_offload_gib": 0}, {"kv_offload_gib": 20}], 2000)
    assert [p["status"] for p in pts] == ["pending", "pending", "pending"], pts
    argv = [" ".join(tune.vllm_argv(p["resolved"])) for p in pts]
    assert (
        "--kv-offloading-size 40 " in argv[0]
        and "--kv-offloading" not in argv[1]
        and "--kv-offloading-size 20 " in argv[2]
    )


def test_prune_gives_the_reason_per_point():
    spec = load(RTX)
    cands = [
        {"kv_cache_dtype": "auto", "enable_chunked_prefill": True, "max_num_batched_tokens": None},
        {"kv_cache_dtype": "fp8", "enable_chunked_prefill": True, "max_num_batched_tokens": None},
        {"kv_cache_dtype": "auto", "enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
        {
            "kv_cache_dtype": "auto",
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": None,
            "gpu_memory_utilization": 0.9,
        },
    ]
    pts = tune.prune(spec, cands, workload_tokens=256)
    assert [p["status"] for p in pts] == ["pending", "skipped", "skipped", "skipped"]
    assert "FP8 KV cache needs compute capability 8.9" in pts[1]["reason"]  # the checks (Ampere)
    assert "below max_model_len 4096 with chunked prefill off" in pts[2]["reason"]
    assert pts[3]["reason"] == "same vLLM command line and environment as p00"  # 0.9 is the profile's value


def test_prune_by_the_planner():
    spec = load(RTX)
    pts = tune.prune(spec, [{"gpu_memory_utilization": 0.3}], 256)  # the hardware checks run the planner first
    assert (
        pts[0]["status"] == "skipped"
        and "does not fit on rtx3090" in pts[0]["reason"]
        and "0 tokens" in pts[0]["reason"]
    )
    # the KV cache of a 3090 (0.90, AWQ) holds ~15.8k blocks = ~253k tokens: 256 sequences of 4096 tokens do not fit
    pts = tune.prune(spec, [{"max_num_seqs": 256}], workload_tokens=4096)
    assert (
        pts[0]["status"] == "skipped"
        and "sequences of the workload's 4096 tokens, fewer than max_num_seqs 256" in pts[0]["reason"]
    )
    assert tune.prune(spec, [{"max_num_seqs": 32}], workload_tokens=4096)[0]["status"] == "pending"


def fake_measure(limit: float, calls: list):
    def measure(load):
        calls.append(load)
        lat = 10 * load
        return {"p99_ttft_ms": lat, "p99_tpot_ms": 1, "completed": 8, "failed": 0, "output_throughput": 100 * load}

    return measure


@pytest.mark.parametrize(
    "limit,expect,probes", [(75, 7, [1, 2, 4, 8, 6, 7]), (5, None, [1]), (1000, 16, [1, 2, 4, 8, 16])]
)
def test_search_doubles_then_bisects(limit, expect, probes):
    calls: list = []
    best, pr = tune.search(fake_measure(limit, calls), lambda m: m["p99_ttft_ms"] <= limit, lo=1, hi=16, max_probes=8)
    assert best == expect and calls == probes and [p["load"] for p in pr] == probes


def test_search_is_bounded():
    calls: list = []
    best, _ = tune.search(fake_measure(75, calls), lambda m: m["p99_ttft_ms"] <= 75, lo=1, hi=64, max_probes=3)
    assert best == 4 and calls == [1, 2, 4]


def test_search_by_rate():
    best, pr = tune.search(lambda r: {"x": r}, lambda m: m["x"] <= 3.3, lo=0.5, hi=16, integer=False, max_probes=10)
    assert 2.9 < best <= 3.3 and pr[-1]["load"] != pr[-2]["load"]


def pt(pid, tok, lat):
    return {
        "id": pid,
        "settings": {"max_num_seqs": tok},
        "status": "measured",
        "best_load": 1,
        "best": {"output_throughput": tok, "p99_tpot_ms": lat, "p99_ttft_ms": lat * 10},
    }


def test_pareto_front_and_winner():
    pts = [
        pt("a", 100, 5),
        pt("b", 200, 8),
        pt("c", 150, 9),
        pt("d", 300, 12),
        pt("e", 300, 15),
        {"id": "f", "settings": {}, "status": "measured", "best": None},
    ]
    front = tune.pareto(pts, "p99_tpot_ms")
    assert [p["id"] for p in front] == ["a", "b", "d"]
    assert tune.winner(front, "p99_tpot_ms")["id"] == "d"
    assert tune.winner([], "p99_tpot_ms") is None


def test_closest_says_how_far():
    p = {
        "id": "p01",
        "settings": {"max_num_seqs": 8},
        "probes": [{"load": 1, "metrics": {"p99_ttft_ms": 600, "completed": 4, "failed": 0}}],
    }
    text = tune.closest([p], {"ttft_p99_ms": 500})
    assert "p01" in text and "ttft_p99_ms 600.0 (limit 500)" in text and "1.20x the target" in text


def test_merge_overlay_none_deletes():
    raw = {"engine": {"profile": "realtime", "max_num_batched_tokens": 4096}, "name": "x"}
    assert tune.merge(raw, {"engine": {"max_num_batched_tokens": None, "max_num_seqs": 8}}) == {
        "engine": {"profile": "realtime", "max_num_seqs": 8},
        "name": "x",
    }
    assert raw["engine"]["max_num_batched_tokens"] == 4096


def state_for(tmp_path, win, base):
    return {
        "deployment": "qwen7b-awq-rt",
        "host": "gpu1",
        "target": {"tpot_p99_ms": 10},
        "workload": {"input_len": 128, "output_len": 128},
        "spec_file": str(RTX),
        "spec_sha256": "ab" * 32,
        "load_kind": "concurrency",
        "started": "2026-12-01T00:00:00Z",
        "vllm_version": "vllm 0.33.0",
        "gpu": "NVIDIA GeForce RTX 3090 (driver 570)",
        "points": [base, win],
        "front": [win],
        "winner": win,
        "overlay_file": None,
        "closest": None,
    }


def test_overlay_validates_merged_and_carries_the_evidence(tmp_path):
    win = pt("p03", 900.0, 7.1)
    win["settings"] = {"max_num_seqs": 32, "max_num_batched_tokens": None, "enable_prefix_caching": True}
    win["best"].update(completed=64, failed=0, p99_itl_ms=8.0)
    win["best_load"] = 16
    base = pt("p00", 600.0, 6.0)
    base["best_load"] = 8
    spec = load(RTX)
    ov, tuned = tune.write_overlay(tmp_path, spec, state_for(tmp_path, win, base), win, base)
    text = ov.read_text()
    assert (
        "# evidence: concurrency 16 meets it" in text and "900 output tok/s" in text and "+50 % output tokens/s" in text
    )
    assert yaml.safe_load(text) == {
        "engine": {"max_num_seqs": 32, "max_num_batched_tokens": None, "enable_prefix_caching": True}
    }
    # the independent reader: the CLI's own validate on the merged spec
    shutil_key = tmp_path / "key"
    data = yaml.safe_load(tuned.read_text())
    assert data["engine"]["max_num_seqs"] == 32 and "max_num_batched_tokens" not in data["engine"]
    data["server"]["api_key"] = {"file": str(shutil_key), "generate": True}
    tuned.write_text(yaml.safe_dump(data))
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet", "validate", str(tuned)], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_tune_report_files(tmp_path):
    win = pt("p01", 900.0, 7.1)
    win["probes"] = [{"load": 1, "ok": True, "metrics": win["best"]}]
    st = state_for(tmp_path, win, pt("p00", 600.0, 6.0))
    st["points"].append(
        {"id": "p02", "settings": {"max_num_seqs": 64}, "status": "skipped", "reason": "planner: does not fit"}
    )
    files = report.tune_report(st, tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert files[0] == tmp_path / "report.html"
    assert (
        html.count("<svg") >= 2 and "Pareto front" in html and "winner: p01" in html and "planner: does not fit" in html
    )
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # self-contained
    try:
        __import__("matplotlib")
        assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        import html as h

        assert h.escape(report.NO_PNG) in html


def test_bench_report_files(tmp_path):
    runs = []
    for target in ("proxy", "direct"):
        for c in (1, 4, 16):
            runs.append(
                {
                    "target": target,
                    "concurrency": c,
                    "result": {
                        "p50_ttft_ms": 10 * c,
                        "p99_ttft_ms": 20 * c,
                        "p50_tpot_ms": 2.0,
                        "p99_tpot_ms": 3.0,
                        "p50_itl_ms": 2.0,
                        "p99_itl_ms": 4.0,
                        "output_throughput": 100.0 * c,
                        "completed": 16,
                        "failed": 0,
                    },
                }
            )
    result = {
        "deployment": "lab-tiny",
        "host": "lab2",
        "time_utc": "t",
        "runs": runs,
        "spec_file": "s.yaml",
        "spec_sha256": "0" * 64,
        "dataset": {"name": "random"},
        "targets": {"proxy": "http://127.0.0.1:80"},
        "host_info": {
            "vllm_version": "vllm 0.32.0+cpu",
            "gpus": [],
            "accelerator_note": "no GPU: nvidia-smi is not installed",
        },
    }
    report.bench_report(result, tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert html.count("<svg") == 4 and "TTFT (ms)" in html and "TPOT (ms)" in html and "ITL (ms)" in html
    assert "proxy p99" in html and "direct p50" in html and "no GPU: nvidia-smi is not installed" in html
    from vllm_fleet.commands.bench import format_table

    table = format_table(runs)
    assert table.splitlines()[0].split()[:3] == ["path", "load", "TTFT"] and "c=16" in table


# ---------------------------------------------------------------------------------------------
# a whole sweep against a fake host session (no SSH, no pyinfra)


INV = """
servers = [
    ("lab1", {"ssh_hostname": "10.10.0.11", "ssh_user": "lab"}),
    ("lab2", {"ssh_hostname": "10.10.0.12", "ssh_user": "lab"}),
]
proxy = [("lab1", {"ssh_hostname": "10.10.0.11", "ssh_user": "lab"})]
"""


class FakeSession:
    """benchhost's answers: throughput and latency grow with concurrency and max_num_seqs."""

    applied: list = []

    def __init__(self, view, host, resolved, key, say):
        self.seqs = 16

    def call(self, op, **req):
        if op == "info":
            return {"vllm_version": "vllm 0.32.0+cpu", "gpus": [], "accelerator_note": "no GPU"}
        if op == "read":
            return {
                "files": {p: {"content": "orig", "mode": 0o644, "owner": "root", "group": "root"} for p in req["paths"]}
            }
        if op == "apply":
            unit = [f["content"] for p, f in req["files"].items() if p.endswith(".service")]
            FakeSession.applied.append(unit[0] if unit else "")
            if unit and "--max-num-seqs" in unit[0]:
                self.seqs = int(unit[0].split("--max-num-seqs ")[1].split()[0])
            return {"ok": True, "restart_s": 1.0, "drain_s": 0.0}
        if op == "bench":
            c = req.get("concurrency") or req["rate"]
            return {
                "result": {
                    "p99_ttft_ms": 20.0 * c,
                    "p99_tpot_ms": 1.0 + c / self.seqs,
                    "output_throughput": 50.0 * min(c, self.seqs),
                    "completed": req["num_prompts"],
                    "failed": 0,
                },
                "wall_s": 0.1,
            }
        raise AssertionError(op)

    def close(self):
        pass


def make_tuner(tmp_path, monkeypatch, **kw):
    inv = tmp_path / "inv.py"
    inv.write_text(INV)
    spec = yaml.safe_load((REPO / "deployments" / "lab-tiny-replicas.yaml").read_text())
    spec["server"]["api_key"] = {"file": str(tmp_path / "key"), "generate": True}
    (tmp_path / "key").write_text("k" * 32)
    (tmp_path / "key").chmod(0o600)
    sp = tmp_path / "spec.yaml"
    sp.write_text(yaml.safe_dump(spec))
    steps = []

    def runner(argv, env):
        steps.append((env["VLLM_FLEET_ROLLOUT_STEP"], env["VLLM_FLEET_UPSTREAM_DOWN"], argv[argv.index("--limit") + 1]))
        return 0, "ok"

    monkeypatch.setattr(tune, "HostSession", FakeSession)  # the session tune opens (vllm_fleet.serving.session's)
    target = kw.pop("target", {"ttft_p99_ms": 100, "tpot_p99_ms": 2})
    grid = kw.pop("grid", {"max_num_seqs": [4, 8, 16], "gpu_memory_utilization": [0.9, 0.95]})
    t = tune.Tuner(
        str(inv),
        str(sp),
        target,
        str(tmp_path / "out"),
        say=lambda m: None,
        grid=grid,
        runner=runner,
        **{"max_probes": 6, **kw},
    )
    return t, steps


def test_sweep_end_to_end_with_a_fake_host(tmp_path, monkeypatch):
    FakeSession.applied = []
    t, steps = make_tuner(tmp_path, monkeypatch)
    assert (
        t.rep.id == "lab2:0" and t.rep.unit == "vllm-lab-tiny-replicas-0.service"
    )  # the replica not on the proxy host
    st = t.run()
    assert steps == [("upstream", "lab2:0", "lab1"), ("upstream", "", "lab1")]  # out by instance id, then back in
    assert FakeSession.applied[-1] == "orig"  # its own unit back, last
    # p00 (max_num_seqs 16, the spec's) is measured last: the replica then ends on its own files
    assert [u.split("--max-num-seqs ")[1].split()[0] for u in FakeSession.applied[:-1]] == ["4", "8", "16"]
    statuses = {p["id"]: p["status"] for p in st["points"]}
    assert list(statuses.values()).count("measured") == 3 and list(statuses.values()).count("skipped") == 3
    # ttft <= 100 -> concurrency <= 5; tpot 1 + c/seqs <= 2 -> c <= seqs: seqs 4 -> 4, 8 and 16 -> 5
    best = {p["settings"]["max_num_seqs"]: p["best_load"] for p in st["points"] if p["status"] == "measured"}
    assert best == {4: 4, 8: 5, 16: 5}
    assert st["winner"]["settings"]["max_num_seqs"] in (8, 16)
    assert (tmp_path / "out" / "overlay.yaml").exists() and (tmp_path / "out" / "report.html").exists()
    assert not (tmp_path / "out" / "original-files.json").exists()
    table = tune.format_table(st)
    assert "winner" in table and "same vLLM command line" in table


def test_the_upstream_step_is_the_rollouts_own_and_a_failure_shows_its_error(tmp_path, monkeypatch):
    import importlib.util

    t, _ = make_tuner(tmp_path, monkeypatch)
    seen = []
    output = "\n".join(
        [f"pyinfra line {i}" for i in range(40)] + ["    [lab1] Error: nginx -t failed", "    the detail"]
    )

    def failing(argv, env):
        seen.append((argv, env))
        return 1, output

    t.runner = failing
    (tmp_path / "out").mkdir()  # run() makes it before the first step
    with pytest.raises(tune.TuneError) as err:
        t.set_upstream(["lab2:0"])
    ((argv, env),) = seen
    module, _, func = argv[3].partition(":")  # the packaged deploy `vllm-fleet rollout` runs: pyinfra loads it by name
    assert (module, func) == ("vllm_fleet.deploys.rollout", "rollout_step")
    assert f"def {func}(" in Path(importlib.util.find_spec(module).origin).read_text()
    assert argv[1:3] == ["-y", str(tmp_path / "inv.py")] and argv[4:] == ["--limit", "lab1"]  # on the proxy only
    assert (env["VLLM_FLEET_ROLLOUT_STEP"], env["VLLM_FLEET_UPSTREAM_DOWN"]) == ("upstream", "lab2:0")
    assert env["VLLM_FLEET_SPEC"] == str(tmp_path / "spec.yaml")  # absolute
    assert "lab2:0 out of the upstream on lab1 failed" in str(err.value)
    assert "Error: nginx -t failed" in str(err.value) and "the detail" in str(err.value)
    assert "pyinfra line 0" not in str(err.value)  # from the error on, not the whole log


def test_resume_runs_only_what_is_left(tmp_path, monkeypatch):
    FakeSession.applied = []
    t, _ = make_tuner(tmp_path, monkeypatch)
    lines = []
    # a cut run: header + the first measured point
    t.prepare_results()
    first = next(p for p in t.points if p["status"] == "pending")
    first.update(
        status="measured",
        best_load=2,
        best={"output_throughput": 1.0, "p99_tpot_ms": 1.0, "p99_ttft_ms": 1.0},
        probes=[],
    )
    tune.append(t.results, tune._row(first))
    with pytest.raises(tune.TuneError, match="pass --resume"):
        make_tuner(tmp_path, monkeypatch)[0].run()
    t2, _ = make_tuner(tmp_path, monkeypatch, resume=True)
    FakeSession.applied = []
    st = t2.run()
    assert len(FakeSession.applied) == 2 + 1  # two points left, then its own files back
    assert next(p for p in st["points"] if p["id"] == first["id"])["best_load"] == 2  # kept, not re-measured
    lines = [json.loads(x) for x in (tmp_path / "out" / "tune.jsonl").read_text().splitlines()]
    assert sum(1 for x in lines if x["kind"] == "header") == 1
    # another target: refused
    t3, _ = make_tuner(tmp_path, monkeypatch, resume=True)
    t3.target = {"ttft_p99_ms": 1}
    with pytest.raises(tune.TuneError, match="another target"):
        t3.prepare_results()


def test_budget_stops_between_points(tmp_path, monkeypatch):
    FakeSession.applied = []
    t, _ = make_tuner(tmp_path, monkeypatch, budget_min=1e-9)
    st = t.run()
    assert [p["status"] for p in st["points"]].count("measured") == 1  # the first point, then out of budget
    assert "not-run" in [p["status"] for p in st["points"]]


def test_only_replica_is_refused(tmp_path, monkeypatch):
    inv = tmp_path / "inv1.py"
    inv.write_text('servers = [("lab1", {})]\nproxy = [("lab1", {})]\n')
    with pytest.raises(tune.TuneError, match="only replica"):
        tune.Tuner(
            str(inv), str(REPO / "deployments" / "lab-tiny.yaml"), {"ttft_p99_ms": 1}, str(tmp_path / "o"), dry=True
        )


def test_cli_bad_target_is_a_usage_error(tmp_path):
    """--target is parsed by argparse (commands.argtypes' convention): exit 2 with usage, before
    the inventory is read."""
    r = subprocess.run(
        [sys.executable, "-m", "vllm_fleet", "tune", str(tmp_path / "never-read.py"), "--target", "bogus=1"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert (
        r.returncode == 2
        and "unknown metric 'bogus'" in r.stderr
        and "usage:" in r.stderr
        and "Traceback" not in r.stderr
    ), r.stderr


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["tune", "/nope.py", "--target", "ttft_p99_ms=1"], "inventory /nope.py: no such file"),
        (["bench", "/nope.py"], "inventory /nope.py: no such file"),
        (["tune", "INV", "--target", "ttft_p99_ms=1", "--grid", "swap_space=4"], "KEY one of"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_1(argv, msg, tmp_path):
    # INV: an inventory of its own (the lab's reads the lab's state: this must not need a lab up)
    inv = tmp_path / "inv.py"
    inv.write_text(
        'servers = [("gpu1", {"ssh_hostname": "192.0.2.10", "vllm_fleet_spec": %r})]\n'
        % str(REPO / "deployments" / "lab-tiny.yaml")
    )
    argv = [str(inv) if a == "INV" else a for a in argv]
    r = subprocess.run([sys.executable, "-m", "vllm_fleet", *argv], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_search_by_request_rate(tmp_path, monkeypatch):
    FakeSession.applied = []
    t, _ = make_tuner(tmp_path, monkeypatch, load_kind="rate", max_load=16, max_probes=8)
    st = t.run()
    # ttft 20 ms x rate <= 100 -> rate <= 5; tpot 1 + rate / seqs <= 2 -> rate <= seqs: the limit is
    # 4 for max_num_seqs 4, 5 for 8 and 16; the geometric bisection lands within 15 % below it
    best = {p["settings"]["max_num_seqs"]: p["best_load"] for p in st["points"] if p["status"] == "measured"}
    for seqs, b in best.items():
        limit = min(5, seqs)
        assert limit / 1.15 < b <= limit, best
    assert "# evidence: rate " in (tmp_path / "out" / "overlay.yaml").read_text()
    with pytest.raises(tune.TuneError, match="another workload"):
        make_tuner(tmp_path, monkeypatch, resume=True)[0].run()  # a concurrency search cannot resume a rate search


# ---------------------------------------------------------------------------------------------
# the layout: replicas are instances (issue 14), a tune restarts one of them


INV2 = """
servers = [("lab1", {"ssh_hostname": "10.10.0.11", "ssh_user": "lab"}),
           ("lab2", {"ssh_hostname": "10.10.0.12", "ssh_user": "lab", "replicas_per_host": 2, "cpu_count": 2})]
proxy = [("lab1", {"ssh_hostname": "10.10.0.11", "ssh_user": "lab"})]
"""


def test_fleet_view_replicas_are_layout_instances(tmp_path):
    from vllm_fleet.commands.bench import targets
    from vllm_fleet.render.fleetview import fleet_view
    from vllm_fleet.specs.inventory import load_inventory
    from vllm_fleet.specs.load import load_and_check

    (tmp_path / "inv.py").write_text(INV2)
    resolved, _ = load_and_check(str(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    v = fleet_view(resolved, load_inventory(str(tmp_path / "inv.py")))
    port = int(resolved["server"]["port"])
    assert [(r.id, r.unit, r.port) for r in v.replicas] == [
        ("lab1:0", "vllm-lab-tiny-replicas-0.service", port),
        ("lab2:0", "vllm-lab-tiny-replicas-0.service", port),
        ("lab2:1", "vllm-lab-tiny-replicas-1.service", port + 1),
    ]
    assert v.proxies == ["lab1"]
    r = v.replica("lab2:1")
    assert (
        r.env_file.endswith("/replica-1.env") and f"/etc/systemd/system/{r.unit}" in r.files and r.env_file in r.files
    )
    assert not any(p.endswith("replica-0.env") or p.endswith("-0.service") for p in r.files)
    assert r.shared and v.replica("lab1").shared == ()  # vllm.env/node.env: shared only with a sibling
    assert v.replica("lab2") is v.replica("lab2:0")
    assert targets(v, "lab2:1") == {
        "proxy": "http://10.10.0.11:%d" % resolved["proxy"]["listen"],
        "direct": f"http://127.0.0.1:{port + 1}",
    }


def test_tune_takes_one_instance_out_and_restarts_only_its_unit(tmp_path, monkeypatch):
    FakeSession.applied = []
    calls = []
    orig_call = FakeSession.call

    def call(self, op, **req):
        calls.append((op, req))
        return orig_call(self, op, **req)

    monkeypatch.setattr(FakeSession, "call", call)
    t, steps = make_tuner(tmp_path, monkeypatch)
    (tmp_path / "inv.py").write_text(INV2)
    t2 = tune.Tuner(
        str(tmp_path / "inv.py"),
        t.spec_path,
        t.target,
        str(tmp_path / "out2"),
        say=lambda m: None,
        grid={"max_num_seqs": [4, 16], "cpu_kv_cache_gib": [1, 2]},
        runner=t.runner,
        max_probes=3,
    )
    assert t2.rep.id == "lab2:1"  # the last instance not on the proxy host
    skipped = {p["id"]: p["reason"] for p in t2.points if p["status"] == "skipped"}
    # cpu_kv_cache_gib goes into vllm.env, which lab2:0 reads too: not tuned on this instance
    assert any("vllm.env" in r and "other replica" in r for r in skipped.values()), skipped
    t2.run()
    assert steps[-2:] == [("upstream", "lab2:1", "lab1"), ("upstream", "", "lab1")]
    applies = [req for op, req in calls if op == "apply"]
    assert applies and all(
        req["unit"] == "vllm-lab-tiny-replicas-1.service" and req["port"] == t2.rep.port for req in applies
    )
    for req in applies[:-1]:  # a point's files: this instance's unit and env file only, no shared file changed
        assert set(req["files"]) <= set(t2.rep.files)
        assert "/etc/systemd/system/vllm-lab-tiny-replicas-0.service" not in req["files"]
    reads = [req for op, req in calls if op == "read"]
    assert reads and set(reads[0]["paths"]) == set(t2.rep.files)


def test_default_grid_token_budget_differs_from_vllms_own_default():
    """vLLM's API server already runs 8192 batched tokens on an H200 (2048 on a 3090): the grid's
    other value must be another setting, not the same one restarted twice."""
    from vllm_fleet.specs import catalog

    h200, _ = load_and_check(H200)
    assert tune.default_grid(h200, catalog.gpu("h200"))["max_num_batched_tokens"] == [None, 16384]
    rtx, _ = load_and_check(RTX)
    assert tune.default_grid(rtx, catalog.gpu("rtx3090"))["max_num_batched_tokens"] == [None, 8192]
    assert tune.default_grid(rtx, catalog.gpu("a100-80gb"))["max_num_batched_tokens"] == [None, 8192]


def test_default_probes_reach_the_highest_load():
    assert tune.default_probes(1, 16) == 7 and tune.default_probes(1, 128) == 10 and tune.default_probes(1, 1) == 3
    # a point with max_num_seqs 128 that meets the target at every load is judged at 128, not at 16
    calls = []
    best, pr = tune.search(
        fake_measure(1e9, calls), lambda m: True, lo=1, hi=128, max_probes=tune.default_probes(1, 128)
    )
    assert best == 128 and calls == [1, 2, 4, 8, 16, 32, 64, 128]


def test_sweep_default_probes_find_the_load_of_a_big_gpu(tmp_path, monkeypatch):
    """Without --max-probes the search of each point reaches its max_num_seqs (the fake host
    meets the target up to concurrency 5 x max_num_seqs / 4: more than the old cap of 5 probes)."""
    FakeSession.applied = []
    t, _ = make_tuner(
        tmp_path, monkeypatch, max_probes=None, grid={"max_num_seqs": [32, 64]}, target={"tpot_p99_ms": 2}
    )
    st = t.run()
    best = {p["settings"]["max_num_seqs"]: p["best_load"] for p in st["points"] if p["status"] == "measured"}
    assert best == {16: 16, 32: 32, 64: 64}


def test_bench_uses_the_servers_tokenizer():
    from vllm_fleet.commands.bench import served_tokenizer

    r, _ = load_and_check(H200)  # --tokenizer MODEL/tokenizer in engine.extra_args
    assert served_tokenizer(r) == "/var/lib/vllm-fleet/h200-qwen7b-bf16/model/tokenizer"
    lab, _ = load_and_check(REPO / "deployments" / "lab-tiny.yaml")
    assert served_tokenizer(lab) == lab["model"]["path"]


def test_host_session_on_local_runs_without_ssh(tmp_path):
    """An @local host (pyinfra's local connector: a GPU machine deploying to itself, no sshd) gets
    the host helper through a local shell, for real: its answers come from this machine."""
    from vllm_fleet.commands.bench import HostSession
    from vllm_fleet.render.fleetview import fleet_view

    spec = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    spec["install"]["prefix"] = str(tmp_path / "prefix")
    (tmp_path / "prefix" / "env" / "bin").mkdir(parents=True)
    (tmp_path / "prefix" / "env" / "bin" / "python").symlink_to(sys.executable)
    sp = tmp_path / "spec.yaml"
    sp.write_text(yaml.safe_dump(spec))
    resolved, _ = load_and_check(sp)
    view = fleet_view(
        resolved, {"@local": {"address": "127.0.0.1", "groups": ["servers"], "data": {"ssh_hostname": "127.0.0.1"}}}
    )
    assert view.replicas[0].host == "@local"

    probe = tmp_path / "probe.txt"
    probe.write_text("on this machine")
    sess = HostSession(view, "@local", resolved, "k" * 32, say=lambda m: None)
    try:
        info = sess.call("info")
        got = sess.call("read", paths=[str(probe)])
    finally:
        sess.close()
    assert sess.p.proc is not None and sess.p.chan is None  # pyinfra's @local: a local process, no SSH
    assert info["hostname"] == __import__("os").uname().nodename
    assert got["files"][str(probe)]["content"] == "on this machine"


def test_a_multi_turn_sweep_sends_conversations_through_the_proxy(tmp_path, monkeypatch):
    """`tune --multi-turn` (issue 37, item 6): each probe is N conversations at once (N the load
    searched), sent through the deployment's proxy with a seed of its own; the metrics judged are
    the workload's TTFT and TPOT under vLLM's benchmark names. Only with a proxy, one replica and
    --in-place (otherwise the proxy would spread the conversations over other replicas)."""
    from vllm_fleet.serving import multiturn

    inv = tmp_path / "inv.py"
    inv.write_text('servers = [("lab1", {"ssh_hostname": "10.10.0.11", "ssh_user": "lab"})]\nproxy = servers\n')
    spec = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    spec["server"]["api_key"] = {"file": str(tmp_path / "key"), "generate": True}
    (tmp_path / "key").write_text("k" * 32)
    (tmp_path / "key").chmod(0o600)
    sp = tmp_path / "spec.yaml"
    sp.write_text(yaml.safe_dump(spec))
    calls = []

    def fake_run(base, model, key, wl, *, seed, run_id, session_header, say):
        unit = FakeSession.applied[-1] if FakeSession.applied else ""
        seqs = int(unit.split("--max-num-seqs ")[1].split()[0]) if "--max-num-seqs " in unit else 16
        c = wl.conversations
        calls.append((base, model, key, c, wl.prefix_words, wl.turns, seed, session_header))
        rec = {
            "ok": True,
            "ttft_s": 0.02 * c,
            "e2e_s": 0.02 * c + (1 + c / seqs) * 47 / 1000,
            "completion_tokens": 48,
            "prompt_tokens": 100,
        }
        return multiturn.summarize([rec] * (c * wl.turns), 1.0)

    monkeypatch.setattr(multiturn, "run_workload", fake_run)
    monkeypatch.setattr(tune, "HostSession", FakeSession)
    FakeSession.applied = []
    mt = {"prefix_words": 100, "turns": 2, "user_words": 5, "output_tokens": 48, "think_s": 0}
    t = tune.Tuner(
        str(inv),
        str(sp),
        {"ttft_p99_ms": 100, "tpot_p99_ms": 2},
        str(tmp_path / "out"),
        say=lambda m: None,
        grid={"max_num_seqs": [4, 8]},
        in_place=True,
        multi_turn=mt,
        max_probes=6,
        runner=lambda a, e: (0, "ok"),
    )
    st = t.run()
    assert (
        {c[0] for c in calls} == {"http://10.10.0.11:80"}
        and {c[1] for c in calls} == {"tiny"}
        and {c[2] for c in calls} == {"k" * 32}
    )
    assert {(c[4], c[5], c[7]) for c in calls} == {(100, 2, "X-Session-Id")}
    assert len({c[6] for c in calls}) == len(calls)  # every run its own seed
    best = {p["settings"]["max_num_seqs"]: p["best_load"] for p in st["points"] if p["status"] == "measured"}
    assert best == {4: 4, 8: 5, 16: 5}  # ttft 20 ms x c <= 100 -> c <= 5; tpot 1 + c/seqs <= 2 -> c <= seqs
    assert st["workload"]["dataset"] == "multi-turn" and st["workload"]["turns"] == 2
    m = multiturn.as_bench_metrics(
        fake_run(
            "u",
            "tiny",
            "k",
            multiturn.Workload(conversations=3, turns=1),
            seed=1,
            run_id="r",
            session_header="X-Session-Id",
            say=None,
        )
    )
    assert m["p99_ttft_ms"] == 60.0 and m["completed"] == 3 and m["failed"] == 0
    with pytest.raises(tune.TuneError, match="--multi-turn sends the conversations through the proxy"):
        make_tuner(tmp_path, monkeypatch, multi_turn=mt)  # two replicas, taken out of the upstream
