#!/usr/bin/env python3
# Installed by vllm-fleet (ExecStartPre of the vLLM unit on a Ray head). Do not edit on the host.
"""Wait until the Ray cluster has the expected nodes and GPUs, or fail naming what is missing.

    wait-ray-cluster --address HEAD:PORT --nodes N --gpus G [--expect ADDR ...] [--timeout S]

Exit 0 when at least N alive nodes with at least G GPUs in all are registered (and every --expect
address is among them); exit 1 at the deadline with the missing node addresses and the counts
seen, so a multi-node start fails with a reason instead of hanging in a placement group.
"""

import argparse
import sys
import time


def snapshot(ray):
    alive = [n for n in ray.nodes() if n.get("Alive")]
    addresses = sorted({n.get("NodeManagerAddress", "?") for n in alive})
    gpus = sum(float((n.get("Resources") or {}).get("GPU", 0)) for n in alive)
    return addresses, gpus


def main(argv=None):
    p = argparse.ArgumentParser(prog="wait-ray-cluster")
    p.add_argument("--address", required=True, help="Ray GCS address HEAD:PORT")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus", type=float, required=True)
    p.add_argument("--expect", action="append", default=[], help="a node address that must be present")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--interval", type=float, default=5)
    args = p.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    connected = False
    addresses, gpus, last_error = [], 0.0, ""
    while True:
        try:
            if not connected:
                ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
                connected = True
            addresses, gpus = snapshot(ray)
            missing = [a for a in args.expect if a not in addresses]
            if len(addresses) >= args.nodes and gpus >= args.gpus and not missing:
                print(
                    f"wait-ray-cluster: ready: {len(addresses)} node(s) {', '.join(addresses)}, {gpus:g} GPU(s)",
                    flush=True,
                )
                return 0
            last_error = ""
        except Exception as exc:  # the head may not be up yet; keep trying until the deadline
            last_error = f"{type(exc).__name__}: {exc}"
            connected = False
            try:
                ray.shutdown()
            except Exception:
                pass
        if time.monotonic() >= deadline:
            break
        time.sleep(args.interval)

    missing = [a for a in args.expect if a not in addresses]
    lines = [
        f"wait-ray-cluster: timed out after {args.timeout:g} s waiting for the Ray cluster at {args.address}:",
        f"  nodes: {len(addresses)} of {args.nodes} alive ({', '.join(addresses) or 'none'}); GPUs: {gpus:g} of {args.gpus:g}",
    ]
    if missing:
        lines.append(
            f"  missing node(s): {', '.join(missing)} (is ray-worker.service running there, and does its NODE_IP match?)"
        )
    if last_error:
        lines.append(f"  last error: {last_error} (is ray-head.service running?)")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
