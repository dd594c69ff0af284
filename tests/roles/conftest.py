"""Role test harness: run a pyinfra ``@deploy`` against scripted facts and read the commands it
would issue, per operation, without connecting to any host.

How it works: a real pyinfra ``State`` + ``Inventory`` with one host (never connected: no fact
command runs), ``Host.get_fact`` replaced by a lookup in the ``facts`` you give, then
``add_deploy``; each operation's command generator is read back from ``state.ops`` in the order
the deploy added them. pyinfra's own operation code runs unchanged (apt.packages really compares
against the DebPackages you script), so the commands are those a real run would send.

API: the ``harness`` fixture (tests never import conftest: other test folders may have their own)::

    def test_something(harness):
        run = harness.run(nvidia, spec,            # deploy function and its arguments
                          facts={LinuxDistribution: harness.distro("debian-12"), HostState: read,
                                 File: harness.per_arg("path", {"/etc/x": {...}}, default=None)},
                          host="gpu1", data={"nvidia_reboot_timeout": 5}, strict=False,
                          groups=["servers"])     # inventory groups of the host (default none)
    run.ops                    # [Op(name, commands: list[str], conditional: bool)] in deploy order
    run.commands               # every command, flattened, in order
    run.changed                # any operation with a command (a second deploy must be False)
    run.op("Blacklist nouveau")          # the one operation whose name contains the text
    run.has_op("reboot")                 # bool, case-insensitive substring of the names
    run.index("sha256sum")               # index in run.commands of the first command containing it
    run.asked                            # [(FactClassName, kwargs)] every fact the deploy read
    run.unscripted                       # facts read but not scripted (their default() was used)
    run.uploads                          # {remote path: text} of files.put / template uploads
                                         # (an atomic put's DEST.tmp-vllm-fleet listed as DEST)

Scripting facts: ``facts`` maps a fact class (or its class name) to either the value, or a
callable ``f(**fact_kwargs)`` returning it (``per_arg`` builds one for a fact keyed by one
argument, e.g. ``File(path=...)``). An unscripted fact returns the fact's ``default()`` (pyinfra's
"absent" state: no file, no packages) and is recorded in ``run.unscripted``; ``strict=True``
raises instead. Commands are strings: ``StringCommand`` rendered raw, ``python.call`` /
``server.reboot`` steps as ``python:<function name>``, uploads as ``upload:<dest>``. An operation
guarded with ``_if=`` is listed with ``conditional=True`` and its commands as if the condition held.

Helpers (also on the fixture): ``harness.distro(name)`` parses tests/roles/fixtures/os-release/<name>
with pyinfra's own LinuxDistribution parser; ``harness.per_arg``; ``harness.fixture_lines(rel)`` reads a fixture as
lines.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the checkout, also without `pip install -e`
    sys.path.insert(0, str(REPO))


def fixture_lines(rel: str) -> list[str]:
    return (FIXTURES / rel).read_text().splitlines()


def distro(name: str) -> dict:
    """A LinuxDistribution fact value from a real os-release file (fixtures/os-release/<name>)."""
    from pyinfra.facts.server import LinuxDistribution

    text = (FIXTURES / "os-release" / name).read_text()
    return LinuxDistribution().process(["/etc/os-release", *text.splitlines(), "---"])


def per_arg(arg: str, values: dict, default: Any = None) -> Callable[..., Any]:
    """A scripted fact keyed by one of its arguments: ``per_arg("path", {"/a": {...}})``."""

    def lookup(**kwargs: Any) -> Any:
        return values.get(kwargs.get(arg), default)

    return lookup


@dataclass
class Op:
    name: str
    commands: list[str]
    conditional: bool = False

    def __repr__(self) -> str:  # readable assertion failures
        flag = " (_if)" if self.conditional else ""
        return f"Op({self.name!r}{flag}: {self.commands!r})"


@dataclass
class DeployRun:
    host: str
    ops: list[Op]
    asked: list[tuple[str, dict]] = field(default_factory=list)
    unscripted: list[str] = field(default_factory=list)
    uploads: dict[str, str] = field(default_factory=dict)  # dest -> text of every file uploaded

    @property
    def commands(self) -> list[str]:
        return [c for op in self.ops for c in op.commands]

    @property
    def changed(self) -> bool:
        return any(op.commands for op in self.ops)

    def _named(self, text: str) -> list[Op]:
        return [op for op in self.ops if text.lower() in op.name.lower()]

    def has_op(self, text: str) -> bool:
        return bool(self._named(text))

    def op(self, text: str) -> Op:
        found = self._named(text)
        assert len(found) == 1, f"expected one operation named like {text!r}, got {found} in {self.ops}"
        return found[0]

    def index(self, text: str) -> int:
        for i, command in enumerate(self.commands):
            if text in command:
                return i
        raise AssertionError(f"no command contains {text!r}: {self.commands}")

    def __repr__(self) -> str:
        return "DeployRun(\n  " + "\n  ".join(map(repr, self.ops)) + "\n)"


def _render(command: Any) -> str:
    from pyinfra.api.command import FileUploadCommand, FunctionCommand, StringCommand

    if isinstance(command, StringCommand):
        return command.get_raw_value()
    if isinstance(command, FunctionCommand):
        return f"python:{getattr(command.function, '__name__', command.function)}"
    if isinstance(command, FileUploadCommand):
        return f"upload:{command.dest}"
    return str(command)


def run_deploy(
    deploy_func: Callable[..., Any],
    *args: Any,
    facts: dict | None = None,
    host: str = "testhost",
    data: dict | None = None,
    strict: bool = False,
    groups: list[str] | None = None,
    **kwargs: Any,
) -> DeployRun:
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.deploy import add_deploy
    from pyinfra.api.host import Host
    from pyinfra.context import ctx_host, ctx_inventory, ctx_state

    scripted = {(k if isinstance(k, str) else k.__name__): v for k, v in (facts or {}).items()}
    asked: list[tuple[str, dict]] = []
    unscripted: list[str] = []

    def fake_get_fact(self: Host, cls: Any, *fargs: Any, **fkwargs: Any) -> Any:
        name = cls.__name__
        fact_kwargs = {k: v for k, v in fkwargs.items() if not k.startswith("_")}
        if fargs:  # a command given as a StringCommand is scripted by its text, as the host's shell reads it
            fact_kwargs["_args"] = tuple(_render(a) if hasattr(a, "get_raw_value") else a for a in fargs)
        asked.append((name, fact_kwargs))
        if name in scripted:
            value = scripted[name]
            if callable(value) and not isinstance(value, type):
                return value(**fact_kwargs)
            return value
        if strict:
            raise AssertionError(f"fact {name}({fact_kwargs}) read but not scripted")
        unscripted.append(name)
        return cls.default() if hasattr(cls, "default") else None

    # never connected: facts are scripted; ``groups``: inventory groups the host is in
    inventory = Inventory(([(host, dict(data or {}))], {}), **{g: ([host], {}) for g in groups or []})
    state = State(inventory, Config())
    state.cwd = os.getcwd()
    original = Host.get_fact
    Host.get_fact = fake_get_fact  # type: ignore[assignment]
    try:
        the_host = inventory.get_host(host)
        with ctx_inventory.use(inventory):  # deploys may read `pyinfra.inventory`
            add_deploy(state, deploy_func, *args, host=the_host, **kwargs)
            with ctx_state.use(state), ctx_host.use(the_host):  # generators read the context host
                ops, uploads = _read_ops(state, the_host)
    finally:
        Host.get_fact = original  # type: ignore[assignment]
    return DeployRun(host=host, ops=ops, asked=asked, unscripted=unscripted, uploads=uploads)


def _upload_text(src: Any) -> str:
    if hasattr(src, "getvalue"):
        value = src.getvalue()
        return value.decode() if isinstance(value, bytes) else value
    try:
        return Path(src).read_text()
    except UnicodeDecodeError:  # a binary file (model weights): its bytes
        return Path(src).read_bytes()


def _read_ops(state: Any, the_host: Any) -> tuple[list[Op], dict[str, str]]:
    from pyinfra.api.command import FileUploadCommand

    ops: list[Op] = []
    uploads: dict[str, str] = {}
    for op_hash in the_host.op_hash_order:
        op_data = state.ops[the_host][op_hash]
        names = sorted(state.op_meta[op_hash].names)
        ifs = op_data.global_arguments.get("_if")
        raw = list(op_data.command_generator())
        for command in raw:
            if isinstance(command, FileUploadCommand):
                # roles.common.atomic_put / secret_file upload to DEST.tmp-vllm-fleet, then mv
                uploads[command.dest.removesuffix(".tmp-vllm-fleet")] = _upload_text(command.src)
        ops.append(Op(names[0] if names else op_hash, [_render(c) for c in raw], conditional=bool(ifs)))
    return ops, uploads


@pytest.fixture
def harness() -> SimpleNamespace:
    """``harness.run`` (run_deploy), ``harness.distro``, ``harness.per_arg``, ``harness.fixture_lines``."""
    return SimpleNamespace(run=run_deploy, distro=distro, per_arg=per_arg, fixture_lines=fixture_lines)


def pytest_configure(config: pytest.Config) -> None:
    """Give the name ``conftest`` back to tests/conftest.py once this file is registered.

    pytest keeps only the last-imported rootless conftest under ``sys.modules["conftest"]``, and
    tests/test_*.py use ``from conftest import ...`` for names of tests/conftest.py. (pytest calls
    this hook when this conftest is registered, after its own import check.)
    """
    parent = Path(__file__).resolve().parents[1] / "conftest.py"
    for plugin in config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == parent:
            sys.modules["conftest"] = plugin
            break
