"""What a deploy needs to know of a Python env, read by that env's own python (standard library
only; run on the host by vllm_fleet/host/scripts/host_state.sh through the HostState fact).

    python env_probe.py dist:NAME ... file:RELPATH ...

Prints ``python X.Y.Z``, then per argument ``dist NAME=VERSION`` (``NAME=`` when absent; read with
importlib.metadata, as vLLM's console script does) or ``file RELPATH=SHA256`` (a file under the
env's purelib; ``RELPATH=`` when absent).
"""

import hashlib
import importlib.metadata as m
import pathlib
import platform
import sys
import sysconfig

print("python", platform.python_version())
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for arg in sys.argv[1:]:
    kind, _, name = arg.partition(":")
    if kind == "dist":
        try:
            print(f"dist {name}={m.version(name)}")
        except m.PackageNotFoundError:
            print(f"dist {name}=")
    elif kind == "file":
        p = site / name
        print(f"file {name}=" + (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""))
