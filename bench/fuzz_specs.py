"""Mutation fuzzing of the spec front door, by hand (issue 12): many more mutants than CI's
tests/test_fuzz_specs.py, with the same generator and checks (tests/fuzzspecs.py).

    .venv/bin/python bench/fuzz_specs.py --count 5000 [--seed 1] [--show 5] [--json out.json]

Prints the counts: mutants, accepted, refused, tracebacks, broken renders (nginx -t or
systemd-analyze verify failed), injections (a marker left its value), paths outside the root,
render-refused (validate accepted what render refuses), bad refusals (no path/fix, wrong exit);
and up to --show examples of each finding. Exit 1 when there is any finding.
Needs nginx and systemd-analyze (as tests/test_rendered_validity.py does).
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

import fuzzspecs  # noqa: E402
import test_rendered_validity as trv  # noqa: E402

KINDS = ["accepted", "refused", "traceback", "broken-render", "injected", "outside", "render-refused", "bad-refusal"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("--json", help="write the counts and examples here")
    args = ap.parse_args()
    if trv.NGINX is None:
        print("fuzz_specs: nginx is needed (apt-get install nginx-light)", file=sys.stderr)
        return 2
    readers = fuzzspecs.Readers(trv._nginx_prefix, trv._nginx_t, trv.systemd_root, trv._commands)
    work = Path(tempfile.mkdtemp(prefix="vllm-fleet-fuzz-work-"))
    counts: collections.Counter[str] = collections.Counter()
    examples: dict[str, list] = collections.defaultdict(list)
    files = [0]

    @hseed(args.seed)
    @settings(max_examples=args.count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(fuzzspecs.mutants())
    def run(m):
        base, changes, doc = m
        out = fuzzspecs.check(fuzzspecs.dump(doc), changes, work, readers)
        counts[out.kind] += 1
        files[0] += out.files
        if not out.ok and len(examples[out.kind]) < args.show:
            examples[out.kind].append(
                {"base": base, "changes": [list(map(repr, c)) for c in changes], "detail": out.detail}
            )

    t0 = time.monotonic()
    try:
        run()
    finally:
        readers.close()
    took = time.monotonic() - t0
    total = sum(counts.values())
    print(f"mutants {total} in {took:.0f} s (seed {args.seed})")
    for k in KINDS:
        print(f"  {k:<15} {counts.get(k, 0)}")
    print(f"  rendered files read back: {files[0]}")
    for k, exs in examples.items():
        for e in exs:
            print(f"\n[{k}] {e['base']} {e['changes']}\n{e['detail']}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "mutants": total,
                    "seconds": round(took),
                    "seed": args.seed,
                    "counts": dict(counts),
                    "files": files[0],
                    "examples": examples,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if all(k in ("accepted", "refused") for k in counts) else 1


if __name__ == "__main__":
    sys.exit(main())
