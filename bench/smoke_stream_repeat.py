"""The smoke's stream-incremental check N times against lab-tiny on the lab's first host, as the smoke
role runs it at the end of a deploy (vllm_fleet.serving.smoke.smoke_checks from the control machine
through nginx; the comparison on the proxy host over plain ssh, the same host script and arguments
as roles/smoke's), and the PASS/WARN/FAIL count. Issue 35's proof of the flake's fix ran it with the
unit tier looping beside it.

    flock /tmp/vf-lab.lock python bench/smoke_stream_repeat.py 20

Needs lab-tiny deployed on lab1 (tests/lab/test_deploy.py's fixture, or `vllm-fleet deploy
inventory/lab.py -y`). Prints one line per run (its stream-incremental line) and the totals.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_fleet.host import programs  # noqa: E402
from vllm_fleet.lab import nspawn  # noqa: E402
from vllm_fleet.render import command, files as render  # noqa: E402
from vllm_fleet.serving import smoke  # noqa: E402
from vllm_fleet.specs.pipeline import load_checked  # noqa: E402

SPEC = REPO / "deployments" / "lab-tiny.yaml"


def main(n: int) -> int:
    spec, _, _ = load_checked(str(SPEC))
    key = Path(os.path.expanduser(spec["server"]["api_key"]["file"])).read_text().strip()
    lab = nspawn.load_state(nspawn.LabConfig())
    first = lab["hosts"][0]
    ssh = ["ssh", "-i", lab["ssh_key"], "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={lab['known_hosts']}"]
    ssh += ["-o", "LogLevel=ERROR", f"root@{first['address']}"]
    base = f"http://{first['address']}"

    def compare(tokens: int) -> dict:
        run = programs.python(
            command.env_python(spec),
            "direct_stream.py",
            spec["server"]["port"],
            spec["model"]["served_name"],
            render.paths(spec)["secrets_env"],
            int(tokens),
            120.0,
            base,
            "-",
            smoke.HOST_PAIRS,
        )
        out = subprocess.run(
            [*ssh, programs.text(run)], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
        )
        try:
            result = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise smoke.SmokeError(f"the streams on {first['name']} printed no result: {out.stderr[-300:]}") from None
        if "error" in result:
            raise smoke.SmokeError(f"the streams on {first['name']}: {result['error']}")
        return result

    count: collections.Counter = collections.Counter()
    t0 = time.monotonic()
    for i in range(1, n + 1):
        t = time.monotonic()
        res = smoke.smoke_checks(base, spec["model"]["served_name"], key, stream_tokens=64, compare_on_host=compare)
        line = next(ln.strip() for ln in res.summary().splitlines() if "stream-incremental" in ln)
        count[line.split()[0]] += 1
        print(f"run {i}: {time.monotonic() - t:.1f} s, load {os.getloadavg()[0]:.1f}: {line}", flush=True)
    print(f"PASS {count['PASS']}, WARN {count['WARN']}, FAIL {count['FAIL']} of {n} in {time.monotonic() - t0:.0f} s")
    return 1 if count["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
