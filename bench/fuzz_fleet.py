"""Fleet fuzzing by hand (issue 21): inventories and host data on the example specs, many more
cases than CI's tests/test_fuzz_specs.py, with the same generator and checks (tests/fuzzfleet.py).
Only TEST-NET addresses (192.0.2.0/24); nothing is connected to.

    .venv/bin/python bench/fuzz_fleet.py --count 4000 [--seed 1] [--show 3] [--json out.json] [--no-readers] [--wired]

--wired draws fuzzfleet.wired_fleets (monitoring across hosts) instead of fuzzfleet.fleets.

Prints the counts: cases, accepted, refused, tracebacks, hangs, broken renders (nginx -t, nft -c,
systemd-analyze verify or promtool failed), injections, altered upstreams, bad refusals; and up to
--show examples of each finding. Exit 1 when there is any finding.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from hypothesis import HealthCheck, given, seed as hseed, settings  # noqa: E402

import fuzzfleet  # noqa: E402
import fuzzspecs  # noqa: E402
import test_rendered_validity as trv  # noqa: E402

KINDS = ["accepted", "refused", "traceback", "hang", "broken-render", "injected", "altered", "unwired", "bad-refusal"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("--json", help="write the counts and examples here")
    ap.add_argument(
        "--no-readers", action="store_true", help="skip nginx -t / nft -c / systemd-analyze / promtool (layout only)"
    )
    ap.add_argument("--wired", action="store_true", help="monitoring across hosts (fuzzfleet.wired_fleets)")
    args = ap.parse_args()
    readers = None
    if not args.no_readers:
        if trv.NGINX is None:
            print("fuzz_fleet: nginx is needed (apt-get install nginx-light)", file=sys.stderr)
            return 2
        spec_readers = fuzzspecs.Readers(trv._nginx_prefix, trv._nginx_t, trv.systemd_root, trv._commands)
        readers = fuzzfleet.Readers(spec_readers, Path(tempfile.mkdtemp(prefix="vllm-fleet-fuzzfleet-")))
    counts: collections.Counter[str] = collections.Counter()
    examples: dict[str, list] = collections.defaultdict(list)
    files = [0]
    scrapes = [0]

    @hseed(args.seed)
    @settings(max_examples=args.count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(fuzzfleet.wired_fleets() if args.wired else fuzzfleet.fleets())
    def run(case):
        specs, inventory, marks = case
        out = fuzzfleet.check(specs, inventory, marks, readers)
        counts[out.kind] += 1
        files[0] += out.files
        scrapes[0] += out.extra.get("scrapes", 0)
        if not out.ok and len(examples[out.kind]) < args.show:
            examples[out.kind].append(
                {"specs": [s["name"] for s in specs], "inventory": repr(inventory)[:1500], "detail": out.detail}
            )

    t0 = time.monotonic()
    try:
        run()
    finally:
        if readers:
            readers.spec.close()
    took = time.monotonic() - t0
    total = sum(counts.values())
    print(f"fleet cases {total} in {took:.0f} s (seed {args.seed}{', layout only' if readers is None else ''})")
    for k in KINDS:
        print(f"  {k:<15} {counts.get(k, 0)}")
    print(f"  rendered files of accepted layouts: {files[0]}")
    print(f"  scrape paths read against firewalls and allow lists: {scrapes[0]}")
    for k, exs in examples.items():
        for e in exs:
            print(f"\n[{k}] {e['specs']} {e['inventory']}\n{e['detail']}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "cases": total,
                    "seconds": round(took),
                    "seed": args.seed,
                    "counts": dict(counts),
                    "files": files[0],
                    "scrapes": scrapes[0],
                    "readers": readers is not None,
                    "examples": examples,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if all(k in ("accepted", "refused") for k in counts) else 1


if __name__ == "__main__":
    sys.exit(main())
