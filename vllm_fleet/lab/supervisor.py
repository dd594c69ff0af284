"""Supervise one lab host: put itself in the host's own cgroups, run systemd-nspawn, and start it
again when the guest reboots (nspawn exits 133). SIGTERM: forward to nspawn (an orderly guest
poweroff) and exit. Started by vllm_fleet.lab.nspawn.start_host with a JSON config path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REBOOT_RC = 133


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    for cg in cfg["cgroups"]:
        os.makedirs(cg, exist_ok=True)
        Path(cg, "cgroup.procs").write_text(f"{os.getpid()}\n")
    state = {"stopping": False, "child": None}

    def on_term(signum, frame):
        state["stopping"] = True
        child = state["child"]
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    pidfile = Path(cfg["nspawn_pid"])
    boots, rc = 0, 0
    while not state["stopping"]:
        with open(cfg["console_log"], "ab") as console:
            console.write(f"\n=== vllm-fleet lab: boot {boots} of {cfg['name']} at {time.ctime()} ===\n".encode())
            console.flush()
            child = subprocess.Popen(cfg["argv"], stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT)
            state["child"] = child
            pidfile.write_text(f"{child.pid}\n")
            if state["stopping"]:
                child.send_signal(signal.SIGTERM)
            rc = child.wait()
        print(f"{time.ctime()} nspawn exited {rc}", flush=True)
        if rc != REBOOT_RC:
            break
        boots += 1
    pidfile.unlink(missing_ok=True)
    return 0 if state["stopping"] else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
