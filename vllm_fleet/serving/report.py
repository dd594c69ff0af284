"""Reports of `vllm-fleet bench` and `vllm-fleet tune`: one self-contained HTML page each (charts
as inline SVG, no script, no external file) and PNG plots when matplotlib is installed (the
package's ``bench`` extra: ``pip install 'vllm-fleet[bench]'``); without it the page says so.

Core module: no pyinfra, no host.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
PANELS = (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL (ms)", "itl_ms"))
NO_PNG = "PNG plots skipped: matplotlib is not installed (pip install 'vllm-fleet[bench]'); the charts below are SVG."


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def svg_chart(
    title: str,
    series: list[dict[str, Any]],
    xlabel: str,
    ylabel: str,
    *,
    logx: bool = False,
    width: int = 420,
    height: int = 280,
    lines: bool = True,
) -> str:
    """A small chart: series = [{label, points: [(x, y)], color?, dashed?, marker?}]."""
    pts = [(x, y) for s in series for x, y in s["points"] if x is not None and y is not None]
    left, right, top, bottom = 56, 12, 26, 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 18 * len(series)}" '
        f'font-family="sans-serif" font-size="11"><title>{html.escape(title)}</title>',
        f'<text x="{width / 2}" y="15" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>',
    ]
    if not pts:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text></svg>')
        return "\n".join(out)
    tx = (lambda x: math.log2(x)) if logx else (lambda x: x)  # noqa: E731
    xs, ys = [tx(x) for x, _ in pts if not logx or x > 0], [y for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = 0.0, max(ys) * 1.1 or 1.0
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pw, ph = width - left - right, height - top - bottom
    X = lambda x: left + (tx(x) - x0) / (x1 - x0) * pw  # noqa: E731
    Y = lambda y: top + ph - (y - y0) / (y1 - y0) * ph  # noqa: E731
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{Y(yv):.1f}" y2="{Y(yv):.1f}" stroke="#eee"/>'
            f'<text x="{left - 4}" y="{Y(yv) + 4:.1f}" text-anchor="end">{_fmt(yv)}</text>'
        )
    xt = sorted({x for x, _ in pts})
    if len(xt) > 8:
        xt = [xt[int(i * (len(xt) - 1) / 7)] for i in range(8)]
    for xv in xt:
        out.append(f'<text x="{X(xv):.1f}" y="{top + ph + 14}" text-anchor="middle">{_fmt(xv)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{top + ph + 30}" text-anchor="middle">{html.escape(xlabel)}</text>')
    out.append(
        f'<text x="12" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 12 '
        f'{top + ph / 2})">{html.escape(ylabel)}</text>'
    )
    for i, s in enumerate(series):
        color = s.get("color") or COLORS[i % len(COLORS)]
        sp = sorted((x, y) for x, y in s["points"] if x is not None and y is not None)
        dash = ' stroke-dasharray="5,3"' if s.get("dashed") else ""
        if lines and len(sp) > 1 and s.get("line", True):
            d = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in sp)
            out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.6"{dash}/>')
        for x, y in sp:
            r = s.get("radius", 3)
            out.append(
                f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="{r}" fill="{color}"><title>{html.escape(s["label"])}: '
                f'{_fmt(x)}, {_fmt(y)}</title></circle>'
            )
        ly = height + 14 * i + 6
        out.append(
            f'<line x1="{left}" x2="{left + 18}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>'
            f'<text x="{left + 24}" y="{ly + 4}">{html.escape(s["label"])}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _page(title: str, body: list[str]) -> str:
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title) + "</title>"
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
        "table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#f4f4f4}"
        ".charts svg{margin:4px;border:1px solid #eee}.win{background:#e6ffe6}.skip{color:#888}"
        "pre{background:#f8f8f8;padding:8px;overflow:auto}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _table(head: list[str], rows: list[list[Any]], classes: list[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape('' if c is None else str(c))}</td>" for c in r) + "</tr>")
    return "\n".join(out + ["</table>"])


def _save_png(plt: Any, fig: Any, png: Path) -> Path:
    """Lay out ``fig``, write it to ``png`` (100 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------------
# bench


def _bench_series(result: dict[str, Any]) -> tuple[str, dict[str, list[tuple[float, dict[str, Any]]]]]:
    kind = "concurrency" if any(r.get("concurrency") for r in result["runs"]) else "rate"
    by: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for r in result["runs"]:
        if r.get("result"):
            by.setdefault(r["target"], []).append((r.get(kind), r["result"]))
    return kind, by


def bench_report(result: dict[str, Any], out: Path) -> list[Path]:
    """report.html (+ bench.png with matplotlib) in ``out``; returns the files written."""
    kind, by = _bench_series(result)
    xlabel = "concurrent requests (--max-concurrency)" if kind == "concurrency" else "request rate (req/s)"
    charts = []
    for title, key in PANELS:
        series = []
        for i, (target, rows) in enumerate(sorted(by.items())):
            for q, dashed in (("p50", False), ("p99", True)):
                series.append(
                    {
                        "label": f"{target} {q}",
                        "points": [(x, r.get(f"{q}_{key}")) for x, r in rows],
                        "color": COLORS[i],
                        "dashed": dashed,
                    }
                )
        charts.append(svg_chart(title, series, xlabel, "ms", logx=kind == "concurrency"))
    charts.append(
        svg_chart(
            "output tokens / s",
            [
                {"label": t, "points": [(x, r.get("output_throughput")) for x, r in rows], "color": COLORS[i]}
                for i, (t, rows) in enumerate(sorted(by.items()))
            ],
            xlabel,
            "tokens/s",
            logx=kind == "concurrency",
        )
    )
    files = []
    plt = _matplotlib()
    png_note = NO_PNG
    if plt:
        fig, axes = plt.subplots(1, 4, figsize=(17, 4))
        for ax, (title, key) in zip(axes, PANELS):
            for i, (target, rows) in enumerate(sorted(by.items())):
                xs = [x for x, _ in rows]
                ax.plot(xs, [r.get(f"p50_{key}") for _, r in rows], "o-", color=COLORS[i], label=f"{target} p50")
                ax.plot(xs, [r.get(f"p99_{key}") for _, r in rows], "^--", color=COLORS[i], label=f"{target} p99")
            ax.set_title(title)
        for i, (target, rows) in enumerate(sorted(by.items())):
            axes[3].plot(
                [x for x, _ in rows], [r.get("output_throughput") for _, r in rows], "o-", color=COLORS[i], label=target
            )
        axes[3].set_title("output tokens / s")
        for ax in axes:
            ax.set_xlabel(xlabel)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"vllm-fleet bench {result['deployment']} on {result['host']} ({result['time_utc']})", fontsize=9)
        png = _save_png(plt, fig, out / "bench.png")
        files.append(png)
        png_note = f"PNG: {png.name}"
    info = result.get("host_info") or {}
    gpu = (
        (", ".join(g["name"] for g in info.get("gpus") or []) + f" (driver {info.get('driver')})")
        if info.get("gpus")
        else (info.get("accelerator_note") or "unknown")
    )
    rows = []
    for r in result["runs"]:
        s = r.get("result") or {}
        rows.append(
            [
                r["target"],
                r.get(kind),
                s.get("p50_ttft_ms"),
                s.get("p99_ttft_ms"),
                s.get("p50_tpot_ms"),
                s.get("p99_tpot_ms"),
                s.get("p50_itl_ms"),
                s.get("p99_itl_ms"),
                s.get("output_throughput"),
                s.get("completed"),
                s.get("failed"),
                r.get("error") or "",
            ]
        )
    rows = [[round(c, 2) if isinstance(c, float) else c for c in row] for row in rows]
    body = [
        f"<h1>vllm-fleet bench: {html.escape(result['deployment'])}</h1>",
        f"<p>{html.escape(result['time_utc'])}; on host {html.escape(result['host'])}; vLLM "
        f"{html.escape(str(info.get('vllm_version')))}; GPU: {html.escape(gpu)}; spec "
        f"{html.escape(result['spec_file'])} (sha256 {result['spec_sha256'][:16]}...); dataset "
        f"{html.escape(json.dumps(result['dataset']))}; paths {html.escape(json.dumps(result['targets']))}</p>",
        f"<p>{html.escape(png_note)}</p>",
        '<div class="charts">',
        *charts,
        "</div>",
        _table(
            [
                "path",
                kind,
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "ITL p50",
                "ITL p99",
                "out tok/s",
                "done",
                "failed",
                "error",
            ],
            rows,
        ),
    ]
    page = out / "report.html"
    page.write_text(_page(f"bench {result['deployment']}", body))
    return [page, *files]


# ---------------------------------------------------------------------------------------------
# tune


def _tune_latency(state: dict[str, Any]) -> tuple[str, str]:
    """(metric key, axis label) of the latency the target bounds: TPOT p99 when it names one, else TTFT p99."""
    lat_key = "p99_tpot_ms" if "tpot_p99_ms" in state["target"] else "p99_ttft_ms"
    return lat_key, "TPOT p99 (ms)" if lat_key == "p99_tpot_ms" else "TTFT p99 (ms)"


def _tune_charts(state: dict[str, Any], measured: list[dict[str, Any]]) -> list[str]:
    """The SVG charts: throughput against latency (points, Pareto front, winner), and every probe of the load search."""
    points, front, winner = state["points"], state["front"], state.get("winner")
    lat_key, lat_label = _tune_latency(state)
    series = [
        {
            "label": "points (best load meeting the target)",
            "points": [(p["best"].get(lat_key), p["best"].get("output_throughput")) for p in measured],
            "color": "#999",
            "line": False,
        },
        {
            "label": "Pareto front",
            "points": [(p["best"].get(lat_key), p["best"].get("output_throughput")) for p in front],
            "color": COLORS[0],
        },
    ]
    if winner:
        series.append(
            {
                "label": f"winner: {winner['id']}",
                "points": [(winner["best"].get(lat_key), winner["best"].get("output_throughput"))],
                "color": COLORS[3],
                "radius": 6,
            }
        )
    charts = [
        svg_chart("throughput vs latency (Pareto front)", series, lat_label, "output tokens / s", width=560, height=340)
    ]
    # every probe of every point: the load search
    probes = []
    for i, p in enumerate(p for p in points if p.get("probes")):
        probes.append(
            {
                "label": p["id"],
                "points": [(pr["load"], pr["metrics"].get(lat_key)) for pr in p["probes"] if pr.get("metrics")],
                "color": COLORS[i % len(COLORS)],
            }
        )
    if probes:
        charts.append(
            svg_chart(
                f"load search: {lat_label} per probe",
                probes,
                state.get("load_kind", "concurrency"),
                "ms",
                width=560,
                height=340,
            )
        )
    return charts


def _tune_png(plt: Any, state: dict[str, Any], measured: list[dict[str, Any]], png: Path) -> Path:
    """pareto.png: the throughput/latency chart drawn with matplotlib."""
    front, winner = state["front"], state.get("winner")
    lat_key, lat_label = _tune_latency(state)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(
        [p["best"].get(lat_key) for p in measured],
        [p["best"].get("output_throughput") for p in measured],
        color="#999",
        label="points",
    )
    fx = [p["best"].get(lat_key) for p in front]
    ax.plot(fx, [p["best"].get("output_throughput") for p in front], "o-", color=COLORS[0], label="Pareto front")
    if winner:
        ax.scatter(
            [winner["best"].get(lat_key)],
            [winner["best"].get("output_throughput")],
            s=120,
            color=COLORS[3],
            label=f"winner {winner['id']}",
        )
    for p in measured:
        ax.annotate(p["id"], (p["best"].get(lat_key), p["best"].get("output_throughput")), fontsize=6)
    ax.set_xlabel(lat_label)
    ax.set_ylabel("output tokens / s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"vllm-fleet tune {state['deployment']} on {state['host']}", fontsize=9)
    return _save_png(plt, fig, png)


#: The columns of the tune report's table: one row a point.
TUNE_HEAD = [
    "point",
    "settings",
    "status",
    "best load",
    "TTFT p99",
    "TPOT p99",
    "out tok/s",
    "restart s",
    "warm-up s",
    "search s",
    "why",
]


def _tune_rows(state: dict[str, Any]) -> tuple[list[list[Any]], list[str]]:
    """(rows, row classes) of the table: every point, the winner and the skipped marked."""
    points, front, winner = state["points"], state["front"], state.get("winner")
    rows, classes = [], []
    front_ids = {p["id"] for p in front}
    for p in points:
        b = p.get("best") or {}
        t = p.get("times") or {}
        rows.append(
            [
                p["id"],
                ", ".join(f"{k}={v}" for k, v in p["settings"].items()),
                p["status"] + (" (front)" if p["id"] in front_ids else ""),
                p.get("best_load"),
                _r(b.get("p99_ttft_ms")),
                _r(b.get("p99_tpot_ms")),
                _r(b.get("output_throughput")),
                t.get("restart_s"),
                t.get("warmup_s"),
                t.get("search_s"),
                p.get("reason") or "",
            ]
        )
        classes.append("win" if winner and p["id"] == winner["id"] else "skip" if p["status"] == "skipped" else "")
    return rows, classes


def _tune_verdict(state: dict[str, Any]) -> str:
    """The winner and what it reaches, or why there is none."""
    winner = state.get("winner")
    return (
        f"<p><b>winner: {html.escape(winner['id'])}</b> ({html.escape(json.dumps(winner['settings']))}): "
        f"{html.escape(str(winner['best_load']))} {html.escape(state.get('load_kind', 'concurrency'))} meets the "
        f"target at {_r(winner['best'].get('output_throughput'))} output tokens/s. Overlay: "
        f"{html.escape(state.get('overlay_file') or '-')}</p>"
        if winner
        else f"<p><b>no winner</b>: {html.escape(state.get('closest') or 'no point was measured')}</p>"
    )


def tune_report(state: dict[str, Any], out: Path) -> list[Path]:
    """report.html (+ pareto.png with matplotlib): every point, the Pareto front, the winner."""
    points, target = state["points"], state["target"]
    measured = [p for p in points if p.get("best")]
    charts = _tune_charts(state, measured)
    files = []
    plt = _matplotlib()
    png_note = NO_PNG
    if plt and measured:
        png = _tune_png(plt, state, measured, out / "pareto.png")
        files.append(png)
        png_note = f"PNG: {png.name}"
    rows, classes = _tune_rows(state)
    body = [
        f"<h1>vllm-fleet tune: {html.escape(state['deployment'])}</h1>",
        f"<p>target {html.escape(json.dumps(target))}; on {html.escape(state['host'])}; "
        f"{html.escape(state.get('vllm_version') or '')}; GPU: {html.escape(state.get('gpu') or '-')}; started "
        f"{html.escape(state.get('started') or '')}; {len(points)} point(s)</p>",
        _tune_verdict(state),
        f"<p>{html.escape(png_note)}</p>",
        '<div class="charts">',
        *charts,
        "</div>",
        _table(TUNE_HEAD, rows, classes),
    ]
    page = out / "report.html"
    page.write_text(_page(f"tune {state['deployment']}", body))
    return [page, *files]


def _r(v: Any) -> Any:
    return round(v, 2) if isinstance(v, float) else v
