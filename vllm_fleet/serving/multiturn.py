"""A multi-turn chat workload, and its comparison across routing policies.

    wl = Workload(conversations=96, prefix_words=3000, turns=8, user_words=60, output_tokens=48, think_s=3)
    result = run_workload(base_url, model, key, wl, seed=1)      # one run against one endpoint

Each conversation is one thread: a private prefix (random words, ~1 token each for a 7B model's
tokenizer; the counts of the server are reported as ``prompt_tokens``), optionally after a system
prompt shared by every conversation of the run, then ``turns`` user turns; every turn resends the
whole conversation so far (as chat clients do) with its answer appended, and waits a random
0..``think_s`` seconds before the next. Every request is streamed (TTFT = first content chunk) with
exactly ``output_tokens`` generated (``min_tokens`` = ``max_tokens``, vLLM's extension) and carries
``X-Session-Id: <run>-<conversation>`` (or the deployment's proxy.routing.session_header): only the
``session`` policy looks at it. Each run draws new words (its own seed: the invocation's, from the
clock unless ``--seed`` repeats one, plus the run's number): one run's cache cannot serve
another's prompts, in one invocation or across invocations against a warm server.

:func:`prefix_counters` reads each replica's own ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` (tokens), the CPU tier's ``vllm:external_prefix_cache_*`` and
offload bytes (engine.kv_offload), and ``vllm:request_success_total`` on its host (over SSH, from
127.0.0.1): the hit rates of a run are the differences of the sums before and after.

Core module: no pyinfra. Only ``requests`` and the standard library.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import requests

GIB = 1024**3

from vllm_fleet.host import programs
from vllm_fleet.host.transport import Transport
from vllm_fleet.serving.session import load_fleet
from vllm_fleet.serving.words import WORDS

#: Short common English words: about one token each for Qwen/Llama tokenizers.
COUNTERS = {
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:request_success_total": "requests",
    # the KV cache's CPU tier (engine.kv_offload): prompt tokens its connector served, and
    # the bytes it moved (vLLM >= 0.21's flat names; 0.20's one counter by transfer_type)
    "vllm:external_prefix_cache_hits_total": "ext_hits",
    "vllm:external_prefix_cache_queries_total": "ext_queries",
    "vllm:kv_offload_load_bytes_total": "load_bytes",
    "vllm:kv_offload_store_bytes_total": "store_bytes",
    "vllm:kv_offload_total_bytes_total{transfer_type=cpu_to_gpu}": "legacy_load_bytes",
    "vllm:kv_offload_total_bytes_total{transfer_type=gpu_to_cpu}": "legacy_store_bytes",
}
#: What a run reports per replica (counter_delta), after the legacy bytes are folded in.
DELTAS = ("hits", "queries", "ext_hits", "ext_queries", "load_bytes", "store_bytes", "requests")


@dataclass
class Workload:
    conversations: int = 16
    prefix_words: int = 200  # private prefix of each conversation
    system_words: int = 0  # a system prompt shared by every conversation of the run (0: none)
    turns: int = 4
    user_words: int = 20  # new words per user turn
    output_tokens: int = 16
    think_s: float = 1.0  # each conversation waits uniform(0, think_s) between turns
    concurrency: int = 0  # conversations in flight at once (0: all)
    timeout_s: float = 300.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _one_request(
    session: requests.Session, url: str, headers: dict[str, str], body: dict[str, Any], timeout: float
) -> dict[str, Any]:
    t0 = time.monotonic()
    first = None
    text, usage, status = [], None, None
    try:
        with session.post(url, headers=headers, json=body, stream=True, timeout=timeout) as r:
            status = r.status_code
            if r.status_code != 200:
                return {
                    "ok": False,
                    "status": status,
                    "reason": f"HTTP {status}: {r.text[:200]}",
                    "e2e_s": time.monotonic() - t0,
                }
            done = False
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.monotonic()
                        text.append(piece)
            if not done:
                return {
                    "ok": False,
                    "status": status,
                    "reason": "stream ended before [DONE]",
                    "e2e_s": time.monotonic() - t0,
                }
    except requests.RequestException as exc:
        return {
            "ok": False,
            "status": status,
            "reason": f"{type(exc).__name__}: {str(exc)[:200]}",
            "e2e_s": time.monotonic() - t0,
        }
    end = time.monotonic()
    return {
        "ok": True,
        "status": status,
        "ttft_s": (first or end) - t0,
        "e2e_s": end - t0,
        "text": "".join(text),
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "completion_tokens": (usage or {}).get("completion_tokens"),
    }


def run_workload(
    base_url: str,
    model: str,
    api_key: str | None,
    wl: Workload,
    *,
    seed: int,
    run_id: str = "run",
    session_header: str = "X-Session-Id",
    host_header: str | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the workload once against ``base_url`` (the proxy, ``http://HOST[:PORT]``); return the
    per-request records' summary (no counters: see :func:`compare`)."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    system = _words(random.Random(f"{seed}-system"), wl.system_words) if wl.system_words else None
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    slots = threading.Semaphore(wl.concurrency or wl.conversations)

    def conversation(i: int) -> None:
        rng = random.Random(f"{seed}-{i}")
        headers = {"Content-Type": "application/json", session_header: f"{run_id}-{i}"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        if host_header:
            headers["Host"] = host_header
        msgs: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        msgs.append({"role": "user", "content": _words(rng, wl.prefix_words) + "\n\n" + _words(rng, wl.user_words)})
        with slots, requests.Session() as s:
            for turn in range(wl.turns):
                if turn:
                    msgs.append({"role": "user", "content": _words(rng, wl.user_words)})
                body = {
                    "model": model,
                    "messages": msgs,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "max_tokens": wl.output_tokens,
                    "min_tokens": wl.output_tokens,
                    "temperature": 0.0,
                }
                rec = _one_request(s, url, headers, body, wl.timeout_s)
                rec.update(conversation=i, turn=turn, start_s=time.monotonic() - t0)
                text = rec.pop("text", None)
                with lock:
                    records.append(rec)
                if not rec["ok"]:
                    return  # the conversation cannot go on without its answer
                msgs.append({"role": "assistant", "content": text or ""})
                if wl.think_s and turn < wl.turns - 1:
                    time.sleep(rng.uniform(0, wl.think_s))

    t0 = time.monotonic()
    threads = [threading.Thread(target=conversation, args=(i,), daemon=True) for i in range(wl.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return summarize(records, wall)


def summarize(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] * 1000 for r in ok]
    e2e = [r["e2e_s"] * 1000 for r in ok]
    # time per output token after the first, per request (vLLM's bench calls it TPOT)
    tpot = [
        (r["e2e_s"] - r["ttft_s"]) * 1000 / (r["completion_tokens"] - 1)
        for r in ok
        if (r.get("completion_tokens") or 0) > 1
    ]
    out_tok = sum(r.get("completion_tokens") or 0 for r in ok)
    prompt = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    reasons: dict[str, int] = {}
    for r in records:
        if not r["ok"]:
            key = re.sub(r"\d{3,}", "N", r["reason"])[:120]
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": reasons,
        "wall_s": round(wall_s, 2),
        "ttft_ms": {"p50": _r(_pct(ttft, 0.5)), "p90": _r(_pct(ttft, 0.9)), "p99": _r(_pct(ttft, 0.99))},
        "e2e_ms": {"p50": _r(_pct(e2e, 0.5)), "p90": _r(_pct(e2e, 0.9)), "p99": _r(_pct(e2e, 0.99))},
        "tpot_ms": {"p50": _r(_pct(tpot, 0.5), 2), "p90": _r(_pct(tpot, 0.9), 2), "p99": _r(_pct(tpot, 0.99), 2)},
        "output_tokens": out_tok,
        "output_tok_s": round(out_tok / wall_s, 1) if wall_s else None,
        "prompt_tokens": {
            "mean": round(sum(prompt) / len(prompt), 1) if prompt else None,
            "max": max(prompt) if prompt else None,
        },
    }


def _r(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


def as_bench_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's summary under the names of vLLM's serving benchmark (what `vllm-fleet tune` judges:
    ``p99_ttft_ms``, ``p99_tpot_ms``, ``output_throughput``, ``completed``, ``failed``, ...)."""
    out: dict[str, Any] = {
        "completed": summary["ok"],
        "failed": summary["failed"],
        "output_throughput": summary["output_tok_s"],
        "duration": summary["wall_s"],
    }
    for name, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("e2el", "e2e_ms")):
        for q in ("p50", "p90", "p99"):
            out[f"{q}_{name}_ms"] = (summary.get(key) or {}).get(q)
    return out


def proxy_url(resolved: dict[str, Any], view: Any) -> str:
    """The deployment's first proxy as clients reach it (scheme, address, port)."""
    proxy = view.proxies[0]
    address = (view.hosts.get(proxy) or {}).get("address", proxy)
    scheme = "https" if resolved["proxy"]["tls"]["enabled"] else "http"
    return f"{scheme}://{address}:{view.proxy_listen}"


# ---------------------------------------------------------------------------------------------
# Each replica's own counters

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)")


def parse_counters(text: str) -> dict[str, float]:
    """Sum of each wanted counter over its label sets, from a Prometheus text page (a transfer
    type's own series for the ``{transfer_type=...}`` names), as replica_counters.py sums them."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        t = re.search(r'transfer_type="([^"]*)"', m.group(2) or "")
        for key in (m.group(1), f"{m.group(1)}{{transfer_type={t.group(1).lower()}}}" if t else None):
            if key in COUNTERS:
                out[COUNTERS[key]] = out.get(COUNTERS[key], 0.0) + float(m.group(3))
    return out


def prefix_counters(view: Any, python: str, transport: Transport | None = None) -> dict[str, dict[str, float]]:
    """``{replica id: {"hits", "queries", "requests"}}``, read on every replica's host through the
    one transport (host/scripts/replica_counters.py: its /metrics from loopback, one JSON line)."""
    out = {}
    with _transport(view, transport) as t:
        for rep in view.replicas:
            r = t.run(
                rep.host, programs.python(python, "replica_counters.py", str(rep.port), json.dumps(sorted(COUNTERS)))
            )
            if not r.ok or not r.lines:
                raise RuntimeError(
                    f"{rep.id}: could not read its /metrics on the host: {(r.stderr or r.stdout).strip()[-300:]}"
                )
            out[rep.id] = {COUNTERS[k]: v for k, v in json.loads(r.lines[-1]).items()}
    return out


@contextmanager
def _transport(view: Any, transport: Transport | None):
    """The caller's transport (left open), else one for the view's hosts, closed afterwards."""
    if transport is not None:
        yield transport
    else:
        with Transport(view.hosts) as t:
            yield t


def _folded(c: dict[str, float]) -> dict[str, float]:
    """A replica's counters with vLLM 0.20's offload bytes (one counter by transfer_type) read as
    the flat load/store bytes of later releases, where those are absent."""
    out = dict(c)
    for flat in ("load_bytes", "store_bytes"):
        if flat not in out and f"legacy_{flat}" in out:
            out[flat] = out[f"legacy_{flat}"]
    return out


def _rate(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def counter_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per replica and in total: hits (GPU prefix cache) and queries (prompt tokens looked up), the
    CPU tier's hits and queries (``ext_``: vLLM's external prefix cache, i.e. its KV connector) and
    the bytes it loaded (CPU -> GPU) and stored (GPU -> CPU), the hit rates as shares of the
    prompt tokens (``hit_rate``: the GPU's, ``tier_hit_rate``: the CPU tier's, ``total_hit_rate``:
    both), requests."""
    per = {}
    for rid in after:
        a, b = _folded(after[rid]), _folded(before.get(rid) or {})
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in DELTAS}
        d["hit_rate"] = _rate(d["hits"], d["queries"])
        d["tier_hit_rate"] = _rate(d["ext_hits"], d["queries"])
        d["total_hit_rate"] = _rate(d["hits"] + d["ext_hits"], d["queries"])
        per[rid] = d
    tot = {k: sum(d[k] for d in per.values()) for k in DELTAS if k != "requests"}
    return {
        "per_replica": per,
        **tot,
        "hit_rate": _rate(tot["hits"], tot["queries"]),
        "tier_hit_rate": _rate(tot["ext_hits"], tot["queries"]),
        "total_hit_rate": _rate(tot["hits"] + tot["ext_hits"], tot["queries"]),
        "requests_per_replica": {rid: d["requests"] for rid, d in per.items()},
    }


# ---------------------------------------------------------------------------------------------
# Presentation


def format_table(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'policy':<12} {'hit rate':>8} {'CPU tier':>8} {'CPU->GPU':>9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
        f"{'e2e p50':>8} {'tok/s':>7} {'ok':>5} {'failed':>6}  requests per replica"
    )
    lines = [head, "-" * len(head)]
    nan = float("nan")
    for r in runs:
        s, c = r["result"], r.get("counters") or {}
        hr, tier = c.get("hit_rate"), c.get("tier_hit_rate")
        per = " ".join(f"{k}={v:.0f}" for k, v in (c.get("requests_per_replica") or {}).items())
        lines.append(
            f"{r['policy']:<12} {hr if hr is not None else nan:>8.3f} {tier if tier is not None else nan:>8.3f} "
            f"{(c.get('load_bytes') or 0) / GIB:>6.1f}GiB {s['ttft_ms']['p50'] or 0:>7.0f}ms "
            f"{s['ttft_ms']['p90'] or 0:>6.0f}ms {s['ttft_ms']['p99'] or 0:>6.0f}ms {s['e2e_ms']['p50'] or 0:>6.0f}ms "
            f"{s['output_tok_s'] or 0:>7.1f} {s['ok']:>5} {s['failed']:>6}  {per}"
        )
    return "\n".join(lines)


def report(result: dict[str, Any], out: Any) -> list[Any]:
    """routing.html (inline SVG: hit rate, TTFT p50/p99, output tok/s per policy) and, with
    matplotlib, routing.png; returns the files written."""
    from pathlib import Path

    from vllm_fleet.serving.report import COLORS, NO_PNG, _matplotlib, _page, _table, svg_chart

    out = Path(out)
    runs = result["runs"]
    panels = (
        ("prefix-cache hit rate (GPU)", lambda r: (r.get("counters") or {}).get("hit_rate")),
        ("CPU-tier hit rate", lambda r: (r.get("counters") or {}).get("tier_hit_rate")),
        ("CPU -> GPU (GiB)", lambda r: ((r.get("counters") or {}).get("load_bytes") or 0) / GIB),
        ("TTFT p50 (ms)", lambda r: r["result"]["ttft_ms"]["p50"]),
        ("TTFT p99 (ms)", lambda r: r["result"]["ttft_ms"]["p99"]),
        ("e2e p50 (ms)", lambda r: r["result"]["e2e_ms"]["p50"]),
        ("output tok/s", lambda r: r["result"]["output_tok_s"]),
    )
    labels = [f"{r['policy']}{' / ' + r['workload_name'] if r.get('workload_name') else ''}" for r in runs]
    charts = []
    for title, get in panels:
        series = [
            {
                "label": f"{i + 1}: {labels[i]}",
                "points": [(i + 1, get(r))],
                "color": COLORS[i % len(COLORS)],
                "radius": 6,
            }
            for i, r in enumerate(runs)
        ]
        charts.append(svg_chart(title, series, "run (see legend)", title, lines=False))
    rows = []
    for lab, r in zip(labels, runs):
        s, c = r["result"], r.get("counters") or {}
        rows.append(
            [
                lab,
                c.get("hit_rate"),
                c.get("tier_hit_rate"),
                round((c.get("load_bytes") or 0) / GIB, 2),
                round((c.get("store_bytes") or 0) / GIB, 2),
                s["ttft_ms"]["p50"],
                s["ttft_ms"]["p90"],
                s["ttft_ms"]["p99"],
                s["e2e_ms"]["p50"],
                s["output_tok_s"],
                s["ok"],
                s["failed"],
                ", ".join(f"{k}: {v:.0f}" for k, v in (c.get("requests_per_replica") or {}).items()),
            ]
        )
    written = []
    plt = _matplotlib()
    png_note = NO_PNG
    if plt is not None:
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
        for ax, (title, get) in zip(axes, panels):
            vals = [get(r) or 0 for r in runs]
            ax.bar(range(len(runs)), vals, color=[COLORS[i % len(COLORS)] for i in range(len(runs))])
            ax.set_xticks(range(len(runs)), labels, rotation=30, ha="right", fontsize=7)
            ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "routing.png", dpi=110)
        plt.close(fig)
        written.append(out / "routing.png")
        png_note = "PNG: routing.png"
    wl = result.get("workloads") or {}
    body = [
        f"<h1>Routing policies: {result.get('deployment')}</h1>",
        f"<p>{result.get('time_utc')}; endpoint {result.get('base_url')}; workloads: "
        + "; ".join(f"<code>{k}</code> {json.dumps(v)}" for k, v in wl.items())
        + "</p>",
        '<div class="charts">' + "".join(charts) + "</div>",
        _table(
            [
                "run",
                "hit rate (GPU)",
                "CPU-tier hit rate",
                "CPU->GPU GiB",
                "GPU->CPU GiB",
                "TTFT p50 ms",
                "p90",
                "p99",
                "e2e p50 ms",
                "output tok/s",
                "ok",
                "failed",
                "requests per replica",
            ],
            rows,
        ),
        f"<p>{png_note}</p>",
    ]
    (out / "routing.html").write_text(_page(f"routing {result.get('deployment')}", body))
    written.insert(0, out / "routing.html")
    return written


# ---------------------------------------------------------------------------------------------
# One command: every policy side by side (switching = a deploy of the proxy part only)


def policy_spec(spec_path: str, policy: str) -> str:
    """A copy of the spec with ``proxy.routing.policy`` set, beside it (relative paths keep
    working); the caller removes it."""
    import os

    import yaml

    with open(spec_path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    prx = doc.setdefault("proxy", {}) or {}
    doc["proxy"] = prx
    prx.pop("balance", None)
    prx.setdefault("routing", {})
    prx["routing"] = {**(prx["routing"] or {}), "policy": policy}
    d, base = os.path.split(os.path.abspath(spec_path))
    out = os.path.join(d, f".{base.rsplit('.', 1)[0]}.routing-{policy}.yaml")
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"# {base} with proxy.routing.policy: {policy} (vllm-fleet bench --policies; removed afterwards)\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    return out


def main_pids(view: Any, transport: Transport | None = None) -> dict[str, str]:
    """Each replica's vLLM main PID (systemd), to show a policy switch restarted none."""
    with _transport(view, transport) as t:
        return {
            rep.id: t.run(
                rep.host, programs.argv("systemctl", "show", "-p", "MainPID", "--value", rep.unit)
            ).stdout.strip()
            for rep in view.replicas
        }


def switch_policy(
    inventory: str,
    spec_path: str,
    policy: str,
    view: Any,
    *,
    say: Callable[[str], None],
    timeout: float,
    data: Sequence[str] = (),
) -> dict[str, Any]:
    """Deploy the proxy part with ``proxy.routing.policy`` set to ``policy`` (a copy of the spec,
    removed afterwards); the replicas' vLLM main PIDs before and after show that none restarted."""
    import os
    import sys

    tmp = policy_spec(spec_path, policy)
    try:
        pids = main_pids(view)
        t0 = time.monotonic()
        say(f"routing {policy}: deploying the proxy part ({', '.join(view.proxies)})")
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "vllm_fleet",
                "deploy",
                inventory,
                "--spec",
                tmp,
                "-y",
                *[a for h in view.proxies for a in ("--limit", h)],
                *[a for d in data for a in ("--data", d)],
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if p.returncode != 0:
            raise RuntimeError(
                f"the deploy with routing {policy} failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}"
            )
        after = main_pids(view)
    finally:
        os.unlink(tmp)
    switched = {
        "deploy_s": round(time.monotonic() - t0, 1),
        "vllm_main_pids_before": pids,
        "vllm_main_pids_after": after,
        "vllm_restarted": sorted(k for k in pids if pids[k] != after.get(k)),
    }
    say(f"  deployed in {switched['deploy_s']} s; vLLM restarted: {switched['vllm_restarted'] or 'none'}")
    return switched


def new_seed() -> int:
    """A seed of its own for one invocation (from the clock): a second `bench` against a warm
    server sends new conversations, never the last run's again (its cache would answer them)."""
    return time.time_ns() % 1_000_000_007


def compare(
    inventory: str,
    spec_path: str,
    policies: list[str] | None,
    workloads: dict[str, Workload],
    *,
    seed: int | None = None,
    say: Callable[[str], None] = print,
    deploy_timeout: float = 900,
    on_run: Callable[[dict[str, Any]], None] | None = None,
    data: Sequence[str] = (),
) -> dict[str, Any]:
    """For each policy (None: the deployed one only): deploy the proxy part with it, then run
    each workload once, reading every replica's prefix-cache counters before and after.
    ``on_run`` gets the result so far after each run (the command writes it, so that a
    comparison cut short keeps the runs it finished). ``seed``: the invocation's (None: drawn
    from the clock, :func:`new_seed`); run k uses seed + k, recorded in the result."""
    import os

    from vllm_fleet.render import command

    resolved, _, view, key = load_fleet(inventory, spec_path, data=data)
    if not view.proxies or view.proxy_listen is None:
        raise ValueError(
            f"{resolved['name']}: no proxy in front of the replicas (proxy.enabled): routing policies need one"
        )
    base_url = proxy_url(resolved, view)
    header = resolved["proxy"]["routing"]["session_header"]
    python = command.env_python(resolved)
    runs: list[dict[str, Any]] = []
    first = seed = new_seed() if seed is None else seed

    def result(complete: bool) -> dict[str, Any]:
        return {
            "kind": "vllm-fleet bench --multi-turn",
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seed": first,
            "deployment": resolved["name"],
            "spec_file": os.path.abspath(spec_path),
            "base_url": base_url,
            "replicas": [r.id for r in view.replicas],
            "workloads": {k: v.as_dict() for k, v in workloads.items()},
            "complete": complete,
            "runs": list(runs),
        }

    for policy in policies or [None]:
        switched = (
            switch_policy(inventory, spec_path, policy, view, say=say, timeout=deploy_timeout, data=data)
            if policy
            else None
        )
        in_effect = policy or view.policy
        for name, wl in workloads.items():
            seed += 1
            before = prefix_counters(view, python)
            say(f"  {in_effect} / {name}: {wl.conversations} conversations x {wl.turns} turns ...")
            res = run_workload(
                base_url,
                resolved["model"]["served_name"],
                key,
                wl,
                seed=seed,
                run_id=f"{in_effect}-{name}-{seed}",
                session_header=header,
                host_header=None if resolved["proxy"]["server_name"] == "_" else resolved["proxy"]["server_name"],
            )
            time.sleep(1.0)  # the last request's counters
            counters = counter_delta(before, prefix_counters(view, python))
            run = {
                "policy": in_effect,
                "workload_name": name,
                "workload": wl.as_dict(),
                "seed": seed,
                "result": res,
                "counters": counters,
                "switch": switched,
            }
            runs.append(run)
            say("  " + format_table([run]).splitlines()[-1])
            if on_run:
                on_run(result(complete=False))
    return result(complete=True)
