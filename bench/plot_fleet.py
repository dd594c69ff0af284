"""docs/img/fleet-scale.svg from bench/results/lab-fleet-scale.json (bench/fleet_scale.py): per series,
the bytes the control machine sent per model byte and the stage's wall time, against the hosts.
No plotting library: a plain SVG, so it runs with the repo's own venv.

    python3 bench/plot_fleet.py [--results bench/results/lab-fleet-scale.json] [--out docs/img/fleet-scale.svg]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the series drawn: (label, colour, result keys in host order); the keys of today's code only
SERIES = [
    ("unshaped (2,148 MB up to 8 hosts, 538 MB at 16 and 32)", "#1f77b4", ["4", "8", "16", "32"]),
    ("200 Mbit/s, 538 MB", "#ff7f0e", ["1@200mbit", "32@200mbit"]),
    ("50 Mbit/s, 538 MB", "#2ca02c", ["1@50mbit", "32@50mbit"]),
]
W, H, PAD = 460, 300, 50


def panel(x0: int, title: str, ylabel: str, ymax: float, points, target: float | None = None) -> list[str]:
    """One chart: hosts (log2 axis, 1-32) against a value; ``points`` [(label, colour, [(hosts, y)])]."""
    import math

    def px(n: int) -> float:
        return x0 + PAD + (W - 2 * PAD) * math.log2(n) / 5

    def py(y: float) -> float:
        return H - PAD - (H - 2 * PAD) * y / ymax

    out = [f'<text x="{x0 + W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    out.append(f'<line x1="{px(1)}" y1="{py(0)}" x2="{px(32)}" y2="{py(0)}" stroke="black"/>')
    out.append(f'<line x1="{px(1)}" y1="{py(0)}" x2="{px(1)}" y2="{py(ymax)}" stroke="black"/>')
    for n in (1, 2, 4, 8, 16, 32):
        out.append(f'<text x="{px(n)}" y="{py(0) + 16}" text-anchor="middle" font-size="11">{n}</text>')
    for i in range(5):
        y = ymax * i / 4
        out.append(f'<text x="{px(1) - 6}" y="{py(y) + 4}" text-anchor="end" font-size="11">{y:g}</text>')
    out.append(f'<text x="{x0 + W / 2}" y="{H - 12}" text-anchor="middle" font-size="12">hosts</text>')
    out.append(
        f'<text x="{x0 + 14}" y="{H / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 {x0 + 14} {H / 2})">{ylabel}</text>'
    )
    if target is not None:
        out.append(
            f'<line x1="{px(1)}" y1="{py(target)}" x2="{px(32)}" y2="{py(target)}" stroke="red" stroke-dasharray="4"/>'
        )
    for _, colour, pts in points:
        path = " ".join(f"{px(n):.1f},{py(y):.1f}" for n, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out += [f'<circle cx="{px(n):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for n, y in pts]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(REPO / "bench" / "results" / "lab-fleet-scale.json"))
    ap.add_argument("--out", default=str(REPO / "docs" / "img" / "fleet-scale.svg"))
    args = ap.parse_args()
    sizes = json.loads(Path(args.results).read_text())["sizes"]
    ratio, stage = [], []
    for label, colour, keys in SERIES:
        got = [sizes[k] for k in keys if k in sizes]
        ratio.append((label, colour, [(r["hosts"], r["bytes"]["per_model_bytes"]) for r in got]))
        stage.append((label, colour, [(r["hosts"], r["stage"]["wall_s"]) for r in got]))
    top = max(y for _, _, pts in stage for _, y in pts)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 70}" font-family="sans-serif">']
    svg += panel(0, "control machine's bytes / model bytes (target 1.25)", "x model size", 1.5, ratio, 1.25)
    svg += panel(W, "stage wall time", "seconds", round(top / 50 + 1) * 50, stage)
    for i, (label, colour, _) in enumerate(SERIES):
        svg.append(f'<rect x="{PAD}" y="{H + 14 + 16 * i}" width="12" height="12" fill="{colour}"/>')
        svg.append(f'<text x="{PAD + 18}" y="{H + 25 + 16 * i}" font-size="11">{label}</text>')
    svg.append("</svg>")
    Path(args.out).write_text("\n".join(svg) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
