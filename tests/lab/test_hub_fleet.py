"""``model.transfer: hub``, ``model.hub_fetch: fleet`` on the lab: the weights cross the "slow
link" (the hub) once for every host, then reach the hosts from the control machine over the lab
bridge; a second deploy transfers nothing and asks the hub nothing.

The hub is a stand-in (tests/hubstandin.py) on the control machine's loopback, serving the lab's
tiny model: only the control machine can reach it, so a host that tried to download for itself
would fail. Only the model role runs (a deploy file of one call, into a directory of its own
that is removed afterwards), on every host of the session's lab, so the test adds seconds, not a
vLLM deploy. Checked with plain OpenSSH on each host (sha256sum, the marker, mtimes) and the
stand-in's own count of what it served; the numbers are printed (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import pytest

from labkit import REPO, bridge_tx, run

sys.path.insert(0, str(REPO / "tests"))
from hubstandin import StandInHub  # noqa: E402

from vllm_fleet.specs.load import load, resolve  # noqa: E402
from vllm_fleet.lab.tinymodel import DEFAULT_OUT  # noqa: E402

pytestmark = pytest.mark.lab

SOURCE = "lab/tiny-llama"
COMMIT = "5eed" + "0" * 36
PATH = "/var/lib/vllm-fleet/hub-fleet-test/model"

DEPLOY = """
import json
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.roles.model import install_model
spec = json.load(open({spec!r}))
install_model(spec=spec, where=deployment_paths(spec))
"""


def test_weights_from_the_hub_once_per_fleet(lab, lab_hosts, tmp_path):
    built = Path(DEFAULT_OUT).expanduser()
    if not (built / "model.safetensors").is_file():
        pytest.skip(f"the tiny model is not built at {built} (vllm-fleet tiny-model)")
    files = {p.name: p.read_bytes() for p in sorted(built.iterdir()) if p.is_file()}
    files["original/consolidated.00.pth"] = b"\0" * 65536  # left out (model_hub_ignore)
    want_bytes = sum(len(v) for k, v in files.items() if not k.startswith("original/"))
    hub = StandInHub(SOURCE, COMMIT, files, plain=tuple(k for k in files if k.endswith(".json")))
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / "lab-tiny.yaml")))
    spec["model"].update(
        {"transfer": "hub", "hub_fetch": "fleet", "source": SOURCE, "revision": COMMIT, "local_dir": None, "path": PATH}
    )
    spec["server"]["user"] = "root"  # a user every lab host has (bare or not)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "deploy.py").write_text(DEPLOY.format(spec=str(tmp_path / "spec.json")))
    env = {"HF_ENDPOINT": hub.url, "VLLM_FLEET_HUB_CACHE": str(tmp_path / "hub-cache"), "PYTHONPATH": str(REPO)}
    # every host of the lab (inventory/lab.py's `all`)
    argv = [str(Path(sys.executable).parent / "pyinfra"), "-y", "inventory/lab.py", str(tmp_path / "deploy.py")]
    bridge = lab.get("bridge", "vfleet0")
    try:
        # a revision the hub does not have: one message with the fix, the plan stops, no host changed
        bad = dict(spec, model={**spec["model"], "revision": "no-such-tag"})
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        (tmp_path / "bad.py").write_text(DEPLOY.format(spec=str(tmp_path / "bad.json")))
        refused = run([*argv[:-1], str(tmp_path / "bad.py")], env=env, timeout=600)
        assert (
            refused.returncode != 0 and "model.revision 'no-such-tag' does not exist in lab/tiny-llama" in refused.out
        ), refused.out[-4000:]
        assert "Traceback" not in refused.out
        for h in lab_hosts:
            assert h.ssh(f"test -e {Path(PATH).parent}", user="root", check=False).returncode == 1, h.name
        assert hub.served_bytes == 0

        tx0 = bridge_tx(bridge)
        first = run(argv, env=env, timeout=600)
        tx = bridge_tx(bridge) - tx0
        assert first.returncode == 0, first.out[-4000:]
        # the hub served each file once, whatever the number of hosts
        assert hub.served_bytes == want_bytes, (hub.served_bytes, want_bytes)
        received = {}
        for h in lab_hosts:
            check = h.ssh(
                f"cd {PATH} && sha256sum --strict -c MANIFEST.sha256 && cat .vllm-fleet-hub && "
                "find . -type f ! -name MANIFEST.sha256 ! -name .vllm-fleet-hub -printf '%s\\n'",
                user="root",
            )
            assert check.stdout.count(": OK") == len(files) - 1, check.stdout
            assert f"{SOURCE}@{COMMIT}\n" in check.stdout
            received[h.name] = sum(int(x) for x in check.stdout.split("\n") if x.isdigit())
            assert received[h.name] == want_bytes
        mtimes = {
            h.name: h.ssh(f"find {PATH} -type f -printf '%p %T@\\n' | sort", user="root").stdout for h in lab_hosts
        }

        asked = len(hub.requests)
        t0 = time.monotonic()
        second = run(argv, env=env, timeout=600)
        noop_s = time.monotonic() - t0
        assert second.returncode == 0, second.out[-4000:]
        assert len(hub.requests) == asked  # the converged hosts: the hub is not asked
        for h in lab_hosts:  # and nothing was written again
            assert h.ssh(f"find {PATH} -type f -printf '%p %T@\\n' | sort", user="root").stdout == mtimes[h.name]
        print(
            f"\nhub fleet fan-out, {len(lab_hosts)} hosts: the hub served {hub.served_bytes} bytes "
            f"({len(hub.file_requests())} file requests) for {want_bytes} bytes of model; the hosts received "
            f"{sum(received.values())} bytes ({', '.join(f'{k} {v}' for k, v in received.items())}); bridge tx "
            f"{tx} bytes; first deploy {first.elapsed:.1f} s, second (no change, no hub request) {noop_s:.1f} s; "
            f"load {os.getloadavg()[0]:.2f}"
        )
    finally:
        hub.close()
        for h in lab_hosts:
            h.ssh(f"rm -rf {Path(PATH).parent}", user="root", check=False)
