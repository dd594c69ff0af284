"""Control-machine bytes per artifact, before and after host-to-host transfers (issue 36 item 1):
a synthetic model of real files (``transfer: upload``, default 200 MB in 4 files) put on the lab's
hosts by the model role alone (tests/lab/fixtures/model_only.py), once with host data
``peer_fetch=false`` (every host from the control machine, the path before) and once with peers
(the control machine sends it once, the hosts fill each other). Bytes read from the lab bridge's
own tx counter; each run starts from hosts without the model. Run under the lab lock:

    flock /tmp/vf-lab.lock .venv/bin/python bench/peer_bytes.py [--mb 200] [--hosts lab1,lab2,lab3]

Writes bench/results/peer-bytes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "lab"))

from labkit import bridge_tx  # noqa: E402  (the lab bridge's tx counter, one reader)

ROOT = "/var/tmp/vf-peer-bytes/model"
NAME = "peer-bytes"


def ssh(address: str, command: str) -> None:
    st = json.loads(Path("/var/lib/vllm-fleet-lab/state.json").read_text())
    subprocess.run(
        [
            "ssh",
            "-i",
            st["ssh_key"],
            "-o",
            f"UserKnownHostsFile={st['known_hosts']}",
            "-o",
            "BatchMode=yes",
            f"{st['ssh_user']}@{address}",
            command,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--hosts", default="lab1,lab2,lab3")
    args = ap.parse_args()
    st = json.loads(Path("/var/lib/vllm-fleet-lab/state.json").read_text())
    names = args.hosts.split(",")
    addrs = [h["address"] for h in st["hosts"] if h["name"] in names]
    tmp = Path(tempfile.mkdtemp(prefix="peer-bytes-"))
    model = tmp / "model"
    model.mkdir()
    for i in range(4):
        with open(model / f"model-{i:05d}-of-00004.safetensors", "wb") as f:
            for _ in range(args.mb // 4):
                f.write(os.urandom(1 << 20))
    (model / "config.json").write_text("{}")
    size = sum(p.stat().st_size for p in model.iterdir())
    spec = tmp / "spec.yaml"
    spec.write_text(f"""name: {NAME}
model: {{source: {model}, path: {ROOT}, served_name: tiny, dtype: bfloat16, max_model_len: 512}}
server: {{user: daemon}}
proxy: {{auth: none}}
install: {{accelerator: cpu, vllm_version: 0.32.0, env_manager: venv, prefix: /var/tmp/vf-peer-bytes/opt}}
hardware: {{gpu: cpu}}
""")
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    env = {**os.environ, "VF_MODEL_ONLY_SPEC": str(spec), "VLLM_FLEET_LAB_SERVERS": ",".join(names)}
    results = {"hosts": names, "artifact_bytes": size, "runs": []}
    try:
        for mode, extra in (
            ("before: every host from the control machine", ["--data", "peer_fetch=false"]),
            ("after: once, then host to host", []),
        ):
            for a in addrs:
                ssh(a, f"sudo rm -rf /var/tmp/vf-peer-bytes /etc/vllm-fleet/{NAME}")
            before, t0 = bridge_tx(), time.monotonic()
            r = subprocess.run(
                [pyinfra, "-y", *extra, "inventory/lab.py", "tests/lab/fixtures/model_only.py"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            secs, sent = time.monotonic() - t0, bridge_tx() - before
            if r.returncode != 0:
                print(r.stdout[-3000:], r.stderr[-3000:])
                return 1
            results["runs"].append(
                {"mode": mode, "control_bytes": sent, "per_artifact": round(sent / size, 3), "seconds": round(secs, 1)}
            )
            print(
                f"{mode}: {sent / 1e6:.1f} MB sent for a {size / 1e6:.1f} MB model on {len(names)} hosts "
                f"({sent / size:.2f}x), {secs:.1f} s",
                flush=True,
            )
    finally:
        for a in addrs:
            ssh(a, f"sudo rm -rf /var/tmp/vf-peer-bytes /etc/vllm-fleet/{NAME}")
    out = REPO / "bench" / "results" / "peer-bytes.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
