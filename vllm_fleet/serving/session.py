"""The control side of a benchmark or tuning run on a server host: the fleet it runs against
(:func:`load_fleet`) and one session to the helper ``host/scripts/benchhost.py`` there
(:class:`HostSession`). `vllm-fleet bench` (vllm_fleet.commands.bench), the multi-turn workload
(:mod:`vllm_fleet.serving.multiturn`) and `vllm-fleet tune` (:mod:`vllm_fleet.serving.tune`)
share it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from vllm_fleet.render.fleetview import FleetView, fleet_view
from vllm_fleet.host import programs
from vllm_fleet.host.programs import argv
from vllm_fleet.host.transport import HostError, Transport
from vllm_fleet.render import command
from vllm_fleet.render.layout import LayoutError
from vllm_fleet.render.secrets import SecretError, read_secret
from vllm_fleet.specs.inventory import InventoryError, load_inventory
from vllm_fleet.specs.load import SpecError
from vllm_fleet.specs.pipeline import load_checked

BOOTSTRAP = (
    "import json,sys; d=json.loads(sys.stdin.readline()); "
    "exec(compile(d['script'], 'benchhost.py', 'exec'), {'CFG': d['cfg'], '__name__': 'benchhost'})"
)


class BenchError(Exception):
    """Cannot run (bad arguments, spec, inventory, host); says what to do."""


class HostSession:
    """One session to ``host/scripts/benchhost.py`` on a host, through the one transport
    (vllm_fleet.host.transport: pyinfra's connector for the host, @local included):
    ``call(op, **args) -> dict``."""

    def __init__(
        self,
        view: FleetView,
        host: str,
        resolved: dict[str, Any],
        key: str | None,
        say: Callable[[str], None] = print,
        transport: Transport | None = None,
    ):
        cfg = {
            "key": key,
            "model": resolved["model"]["served_name"],
            "tokenizer": served_tokenizer(resolved),
            "vllm": command.env_bin(resolved, "vllm"),
        }
        self.host, self.say = host, say
        self._own = transport is None
        self.transport = transport or Transport(view.hosts)
        try:
            self.p = self.transport.session(host, argv(command.env_python(resolved), "-u", "-c", BOOTSTRAP))
        except HostError as exc:
            raise BenchError(str(exc)) from None
        self.err: list[str] = []
        self._t = threading.Thread(target=self._drain_stderr, daemon=True)
        self._t.start()
        self.p.stdin.write(
            json.dumps({"script": programs.script("benchhost.py"), "cfg": cfg}) + "\n"
        )  # the key: on stdin only
        self.p.stdin.flush()
        first = self.p.stdout.readline()
        if not first.strip().startswith('{"ready"'):
            try:
                self.p.wait(timeout=30)
            except Exception:
                self.p.kill()
            raise BenchError(
                f"{host}: the benchmark helper did not start (rc {self.p.returncode}): "
                + "".join(self.err[-15:]).strip()[-1500:]
                + f"\n  fix: is the deployment installed there ({command.env_python(resolved)})?"
            )

    def _drain_stderr(self) -> None:
        for line in self.p.stderr:
            self.err.append(line)
            del self.err[:-200]

    def call(self, op: str, **req: Any) -> dict[str, Any]:
        self.p.stdin.write(json.dumps({"op": op, **req}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise BenchError(f"{self.host}: the benchmark helper exited: " + "".join(self.err[-15:]).strip()[-1500:])
        return json.loads(line)

    def close(self) -> None:
        try:
            self.p.stdin.write('{"op": "quit"}\n')
            self.p.stdin.close()
            self.p.wait(timeout=30)
        except Exception:
            self.p.kill()
        if self._own:
            self.transport.close()


def served_tokenizer(resolved: dict[str, Any]) -> str:
    """The tokenizer the server runs with: its command line's ``--tokenizer`` (e.g. from
    ``engine.extra_args``), else the model directory. The benchmark counts prompt and output
    tokens with it, so it must be the server's (a model directory without a tokenizer of its own
    fails there: the H200 specs keep theirs in ``MODEL/tokenizer``)."""
    argv = command.vllm_argv(resolved)
    found = resolved["model"]["path"]
    for i, a in enumerate(argv):  # the last one wins, as in vLLM's argument parser
        if a == "--tokenizer" and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith("--tokenizer="):
            found = a.split("=", 1)[1]
    return found


def spec_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_fleet(
    inventory: str, spec_path: str, need_key: bool = True, data: Sequence[str] = ()
) -> tuple[dict[str, Any], Any, FleetView, str | None]:
    """(resolved spec, Spec, view, API key or None when not ``need_key``): every problem as BenchError, nothing
    touched."""
    try:
        resolved, _, spec = load_checked(spec_path)  # the spec read once
    except SpecError as exc:
        text = "\n".join(f"  {p.format()}" for p in exc.problems if p.severity == "error")
        raise BenchError(f"{spec_path}: the spec has errors:\n{text}") from None
    try:
        inv = load_inventory(inventory, data)
        view = fleet_view(resolved, inv)
    except (InventoryError, LayoutError) as exc:
        raise BenchError(str(exc)) from None
    if not view.replicas:
        raise BenchError(f"{inventory}: no replica of {resolved['name']} (no host in the `servers` group runs it)")
    if not need_key:
        return resolved, spec, view, None
    try:
        key = read_secret(resolved["server"].get("api_key"), yaml_path="server.api_key", base_dir=spec.base_dir)
    except SecretError as exc:
        raise BenchError(str(exc)) from None
    return resolved, spec, view, key
