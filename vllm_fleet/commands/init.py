"""`vllm-fleet init [DIR] [--local]`: a commented spec (deployment.yaml) and a pyinfra inventory
skeleton (inventory.py) for your own hosts, to edit and then `vllm-fleet deploy DIR/inventory.py`.
``--local``: the inventory is this machine (pyinfra's ``@local`` connector, no SSH; with sudo when
not run as root), so init, deploy, status is the whole path on the machine under the desk.

The spec's first line hooks the schema up for editors (`# yaml-language-server: $schema=PATH`, the
schema file of this installed package); the spec validates as written (a test checks it). The
inventory names the spec in its hosts' data (`vllm_fleet_spec`), so no --spec is needed.
Existing files are never overwritten (exit 1 says which); `--force` replaces them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

SPEC_NAME = "deployment.yaml"
INVENTORY_NAME = "inventory.py"

SPEC = """\
# yaml-language-server: $schema={schema}
# A vllm-fleet deployment: one vLLM service (+ nginx in front) from this file.
# Every key, its default and its meaning: the schema above (your editor shows them); check with
#   vllm-fleet validate {spec_name}      # every problem with its YAML path and a fix
#   vllm-fleet plan {spec_name}          # GPU memory: weights, KV cache, what fits
name: my-model                          # lower case, digits, '-': names units, paths, nginx site
model:
  source: Qwen/Qwen2.5-7B-Instruct-AWQ  # a hub id (downloaded on each host), or a local directory to upload
  revision: main                        # pin a commit hash: a re-deploy then serves the same bytes
  served_name: qwen2.5-7b-instruct      # the `model` clients ask for
  dtype: float16                        # AWQ needs float16
  quantization: awq_marlin              # not plain awq (much slower decode)
  max_model_len: 4096
  # hub_token: {{env: HF_TOKEN}}          # gated models: a secret reference, never the value
engine:
  profile: realtime                     # realtime (0.90 GPU memory, 16 sequences) or batch (0.95, 64)
server:
  port: 8000                            # vLLM on the host (nginx proxies to it)
  # The API key: read on this machine, written to a 0600 file on the hosts; generated once if missing.
  api_key: {{file: ~/.config/vllm-fleet/my-model.key, generate: true}}
proxy:
  listen: 80                            # nginx; TLS: proxy.tls (certificate + certificate_key files here)
install:
  accelerator: cuda                     # cuda: NVIDIA driver + vLLM; cpu: vLLM's CPU build
  env_manager: venv                     # or conda
hardware:
  gpu: rtx3090                          # `vllm-fleet plan --list-gpus`
  gpus_per_node: 1                      # parallel.tensor defaults to the GPUs of a node
"""

INVENTORY = '''\
"""pyinfra inventory for vllm-fleet (written by `vllm-fleet init`): your hosts, by group.

    vllm-fleet deploy {inventory_name}          # validate, then converge (pyinfra's progress)
    vllm-fleet diff {inventory_name}            # what a deploy would change (exit 1 when something)
    vllm-fleet down {inventory_name}            # remove the deployment (weights stay; --purge)

Groups: `servers` run vLLM (one replica each), `proxy` runs nginx in front of them (and the smoke
tests go through it). Multi-node specs: `ray_workers`. Monitoring: `monitoring`.
Host data: how to connect (ssh_hostname, ssh_user, ssh_key, ssh_port) and `_sudo: True` for a
non-root user with passwordless sudo. `vllm_fleet_spec` names the spec: per host, per group (each
group may have its own spec), or for every host as here; `vllm-fleet deploy --spec` overrides it.
"""

from pathlib import Path

_SPEC = str(Path(__file__).resolve().with_name("{spec_name}"))
_CONNECT = {{"ssh_user": "ubuntu", "_sudo": True, "vllm_fleet_spec": _SPEC}}  # edit: your user (and ssh_key)

servers = [
    ("gpu1", {{"ssh_hostname": "192.0.2.10", **_CONNECT}}),   # edit: your GPU host's address
]
proxy = [
    ("gpu1", {{"ssh_hostname": "192.0.2.10", **_CONNECT}}),   # nginx on the same host
]
'''

LOCAL_INVENTORY = '''\
"""pyinfra inventory for vllm-fleet (written by `vllm-fleet init --local`): this machine.

    vllm-fleet deploy {inventory_name}          # validate, then converge this machine
    vllm-fleet status {inventory_name}          # the unit, vLLM's version, the model, /health
    vllm-fleet diff {inventory_name}            # what a deploy would change (exit 1 when something)
    vllm-fleet down {inventory_name}            # remove the deployment (weights stay; --purge)

`@local` is pyinfra's connector for the machine vllm-fleet runs on: commands run here as a child
process, never over SSH (the same as `vllm-fleet deploy @local --spec {spec_name}`). What it
changes against a server: nginx listens on 127.0.0.1 only (proxy.bind in the spec to serve the
network), vLLM stays on 127.0.0.1 behind it, so no firewall table is written; `down` removes this
deployment's site, units and files and leaves nginx itself and your other sites and services alone.
"""

import os as _os
from pathlib import Path

_SPEC = str(Path(__file__).resolve().with_name("{spec_name}"))

# run as yourself, the system changes (units, /etc/nginx, /opt) go through `sudo -n`: passwordless
# sudo for your user, or run vllm-fleet as root (or set _sudo_password here, as pyinfra reads it)
servers = [("@local", {{"vllm_fleet_spec": _SPEC, "_sudo": _os.geteuid() != 0}})]
'''


def schema_location() -> str:
    from vllm_fleet.specs.load import SCHEMA_PATH

    return SCHEMA_PATH.as_uri()


def write(target: Path, force: bool = False, local: bool = False) -> list[Path]:
    """Write the two files into ``target``; return them. Raise FileExistsError naming the first
    existing one. ``local``: the inventory is this machine (``@local``)."""
    inventory = LOCAL_INVENTORY if local else INVENTORY
    files = {
        target / SPEC_NAME: SPEC.format(schema=schema_location(), spec_name=SPEC_NAME),
        target / INVENTORY_NAME: inventory.format(spec_name=SPEC_NAME, inventory_name=INVENTORY_NAME),
    }
    if not force:
        for p in files:
            if p.exists():
                raise FileExistsError(str(p))
    target.mkdir(parents=True, exist_ok=True)
    for p, text in files.items():
        p.write_text(text)
    return list(files)


def cmd_init(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    try:
        written = write(target, args.force, local=args.local)
    except FileExistsError as exc:
        print(
            f"vllm-fleet init: {exc} exists; nothing was written (edit it, pick another DIR, or --force)",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:  # /proc/x, a file where the directory should be, no permission
        where = exc.filename or target
        print(
            f"vllm-fleet init: cannot write {where}: {exc.strerror or exc}: name a directory you can write "
            "(e.g. vllm-fleet init infra)",
            file=sys.stderr,
        )
        return 1
    for p in written:
        print(f"wrote {p}")
    what = "the spec (model, GPU)" if args.local else "both (hosts, model, GPU)"
    print(
        f"next: edit {what}, then\n  vllm-fleet validate {target / SPEC_NAME}\n"
        f"  vllm-fleet deploy {target / INVENTORY_NAME}\n"
        + (f"  vllm-fleet status {target / INVENTORY_NAME}\n" if args.local else "")
        + f"(the schema: {schema_location()})"
    )
    return 0


def _dir_arg(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty DIR: name the directory to write into (`.` for here)")
    return text


def add_cli(sub: Any) -> None:
    p = sub.add_parser("init", help="write a commented spec and an inventory skeleton for your hosts")
    p.add_argument(
        "dir", metavar="DIR", nargs="?", default=".", type=_dir_arg, help="where to write them (default: here)"
    )
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument(
        "--local",
        action="store_true",
        help="the inventory is this machine (pyinfra's @local: no SSH), for one GPU under the desk",
    )
    p.set_defaults(func=cmd_init)
