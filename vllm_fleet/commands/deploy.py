"""`vllm-fleet deploy INVENTORY [--spec SPEC] [--limit HOSTS] [--dry] [--diff] [--verify] [-y]`.

1. The inventory as pyinfra reads it, without connecting (:mod:`vllm_fleet.specs.inventory`:
   pyinfra's own loader in a child process; its data precedence: ``--data`` > host > group incl. ``group_data/*.py`` >
   all).
2. Each host's spec (:mod:`vllm_fleet.specs.source`; ``--spec`` is passed as ``--data
   vllm_fleet_spec=``): validated (schema, semantic, hardware checks), its secrets readable, its
   model directory present, its files rendered for the hosts that deploy it. Any problem: printed
   with its YAML path (or host) and the fix, exit 1, no host contacted.
3. The model directory of each ``transfer: upload`` spec hashed on this machine before pyinfra
   starts (:func:`hash_models`: vllm_fleet.fetch.treehash, a cache kept across runs, so only
   files not hashed before are read; the deploy process then finds every hash there).
4. pyinfra with the packaged deploy ``vllm_fleet.deploys.serve.serve`` and pyinfra's own progress
   output; ``--dry``/``--diff``/``-y``/``--limit`` are pyinfra's. ``--verify`` is pyinfra's
   ``--data model_verify=true`` (the model role's host data): every file of an uploaded model is
   hashed on the hosts this time, whatever the stamp of their last verified copy says.

A problem of one host found while pyinfra plans it (sudo, disk space, a clash, a state read
that did not complete, a download) fails that host only (roles.common.this_host_only); the
others converge. ``--max-fail N|P%`` stops the run once more than N hosts (P percent) failed
(pyinfra's ``--fail-percent``), ``--parallel`` is pyinfra's. The run ends with the per-host
summary and a retry line for the failed hosts (:mod:`vllm_fleet.commands.outcome`), then the
endpoint of each deployment that serves.

Exit codes (vllm_fleet.commands.outcome): 0 every host done (with ``--dry``: the changes were
shown, nothing was changed); 1 the spec, the inventory or a secret has a problem (nothing was
contacted); 2 usage (also: no -y and no terminal to confirm on); 3 some hosts failed or were not
attempted, the others are done (the summary names them); 4 nothing done (every host failed, or
the run stopped before any finished); 130 interrupted (Ctrl-C; one line says what may still run
on the hosts).

:func:`plan` (steps 1-2) is shared by ``diff`` and ``down``. Core module: pyinfra runs as a
subprocess, as a user runs it; nothing here imports it.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from vllm_fleet.commands.outcome import (
    DONE,
    EXIT_HELP,
    EXIT_INPUT,
    EXIT_NOTHING_DONE,
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    results_file,
)

DEPLOY = "vllm_fleet.deploys.serve.serve"


EXIT_PYINFRA = EXIT_SOME_FAILED  # the name down and older callers use


class PlanError(Exception):
    """The inputs have problems (listed, one per line); no host was contacted."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def pyinfra_bin() -> str:
    beside = Path(sys.executable).parent / "pyinfra"
    return str(beside) if beside.exists() else (shutil.which("pyinfra") or "pyinfra")


def pyinfra_inventory(inventory: str, data: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """{host: {"address", "groups", "data", "order"}} as pyinfra sees the inventory (no connection):
    :func:`vllm_fleet.specs.inventory.load_inventory`, the one reader every command uses."""
    from vllm_fleet.specs.inventory import InventoryError, load_inventory

    try:
        return load_inventory(inventory, data)
    except InventoryError as exc:
        raise PlanError(exc.lines) from None


def select(hosts: dict[str, dict[str, Any]], limit: Sequence[str]) -> list[str]:
    """Hosts matching pyinfra's ``--limit`` (a group name or a glob of host names); all without."""
    if not limit:
        return list(hosts)
    out = [n for n, h in hosts.items() if any(pat in h["groups"] or fnmatch.fnmatch(n, pat) for pat in limit)]
    if not out:
        raise PlanError([f"--limit {','.join(limit)}: matches no host or group of the inventory"])
    return out


def layout_inventory(hosts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The inventory as the renderers want it (what roles.common.inventory_hosts gives the deploy)."""
    from vllm_fleet.render.layout import render_entry

    return {n: render_entry(n, h["groups"], h["data"]) for n, h in hosts.items()}


@dataclass
class Deployment:
    """One spec, the hosts that deploy it, and every file it renders for them."""

    path: str
    resolved: dict[str, Any]
    base_dir: Path
    hosts: list[str]  # in --limit, in inventory order
    inventory: dict[str, dict[str, Any]]  # every host with this spec, as the renderer reads it
    rendered: dict[str, dict[str, Any]]
    connection: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> pyinfra data
    warnings: list[str] = field(default_factory=list)
    secrets: dict[str, Any] = field(default_factory=dict)
    generated: dict[Path, str] = field(default_factory=dict)  # key files the deploy would create


def plan(
    inventory: str, spec: str | None = None, data: Sequence[str] = (), limit: Sequence[str] = ()
) -> tuple[list[Deployment], list[str]]:
    """Steps 1-2: (deployments, pyinfra --data arguments). Raise PlanError listing every problem."""
    from vllm_fleet.render import files as render
    from vllm_fleet.render.layout import LayoutError
    from vllm_fleet.specs import load as specmod
    from vllm_fleet.render.secrets import SecretError, read_spec_secrets
    from vllm_fleet.specs.source import DATA_KEY, SpecSourceError, spec_source

    data = list(data)
    if spec:
        if not Path(spec).is_file():
            raise PlanError([f"--spec {spec}: no such file"])
        data.append(f"{DATA_KEY}={os.path.abspath(spec)}")
    hosts = pyinfra_inventory(inventory, data)
    chosen = select(hosts, limit)
    problems: list[str] = []
    by_spec: dict[str, list[str]] = {}
    for name, h in hosts.items():
        try:
            path, _ = spec_source(h["data"], name)
        except SpecSourceError as exc:
            if name in chosen:
                problems.append(str(exc))
            continue
        by_spec.setdefault(os.path.abspath(os.path.expanduser(path)), []).append(name)
    out: list[Deployment] = []
    for path, names in by_spec.items():
        mine = [n for n in names if n in chosen]
        if not mine:
            continue
        try:
            loaded = specmod.load(path)
            resolved, warnings = specmod.load_and_check(path)
        except specmod.SpecError as exc:
            problems += [f"{path}: {p.format()}" for p in exc.problems if p.severity == "error"]
            continue
        generated: dict[Path, str] = {}
        try:
            secrets = read_spec_secrets(resolved, loaded.base_dir, generated)
        except SecretError as exc:
            problems.append(f"{path}: {exc}")
            continue
        if resolved["model"]["transfer"] == "upload" and not Path(resolved["model"]["local_dir"]).is_dir():
            problems.append(
                f"{path}: model.source: {resolved['model']['local_dir']} is not a directory on this machine "
                "(for the lab: `vllm-fleet tiny-model`)"
            )
            continue
        inv = layout_inventory({n: hosts[n] for n in names})
        try:
            lay = render.build([resolved], inv, sources={resolved["name"]: path})
        except LayoutError as exc:
            problems.append(f"{path}: {exc}")
            continue
        out.append(
            Deployment(
                path,
                resolved,
                loaded.base_dir,
                mine,
                inv,
                lay.files(),
                {n: hosts[n]["data"] for n in names},
                [f"{path}: {p.format()}" for p in warnings] + list(lay.warnings),
                secrets,
                generated,
            )
        )
    if problems:
        raise PlanError(problems)
    return out, data


def run_pyinfra(
    argv: list[str],
    runner: Callable[[list[str]], int] | None = None,
    *,
    what: str = "vllm-fleet",
    again: str = "",
    results: str | None = None,
) -> int:
    """Run pyinfra with its own output on this terminal; its exit status (130 after a Ctrl-C,
    with one line: what may still run on the hosts and ``again``, the command to run next).
    ``results``: the file its per-host results go to (vllm_fleet.commands.outcome)."""
    if runner:
        return runner(argv)
    from vllm_fleet.commands.outcome import with_results
    from vllm_fleet.host.pyinfra_run import run

    return run(argv, what, again or " ".join(argv), env=with_results(None, results) if results else None)


def no_terminal(args: argparse.Namespace, command: str) -> bool:
    """Without -y (and not --dry), pyinfra asks "Press enter to execute..." on the terminal; with
    none (stdin not a TTY: CI, a pipe, cron) say so up front, before anything is read or contacted."""
    if args.yes or getattr(args, "dry", False) or sys.stdin.isatty():
        return False
    print(
        f"vllm-fleet {command}: no terminal to confirm: add -y to {command} without asking "
        "(or --dry to only show what would change); nothing was contacted",
        file=sys.stderr,
    )
    return True


def user_options(args: argparse.Namespace, command: str) -> list[tuple[str, str | None]]:
    """The options the user gave (``(flag, value)``, value None for a bare flag), as a command
    that repeats this run passes them again."""
    out: list[tuple[str, str | None]] = []
    if args.spec:
        out.append(("--spec", args.spec))
    out += [("--limit", h) for h in args.limit or []]
    out += [("--data", d) for d in args.data or []]
    if getattr(args, "max_fail", None) is not None:
        out.append(("--max-fail", str(args.max_fail)))
    if getattr(args, "parallel", None):
        out.append(("--parallel", str(args.parallel)))
    if getattr(args, "verify", False):
        out.append(("--verify", None))
    if getattr(args, "purge", False):
        out.append(("--purge", None))
    return out


def again_command(args: argparse.Namespace, command: str) -> str:
    """The `vllm-fleet COMMAND ... -y` that repeats this run (after a Ctrl-C)."""
    out = ["vllm-fleet", command, args.inventory]
    for flag, value in user_options(args, command):
        if flag != "--purge":  # down adds its own
            out += [flag] + ([value] if value is not None else [])
    return " ".join(out + ["-y"])


def retry_command(args: argparse.Namespace, command: str) -> Callable[[list[str]], str]:
    """``hosts -> the same command on only those hosts`` (pyinfra's --limit), for the summary."""
    from vllm_fleet.commands.outcome import retry_line

    options = user_options(args, command) + ([("-y", None)] if getattr(args, "yes", False) else [])
    return lambda hosts: retry_line(command, [args.inventory], options, hosts)


def finish(command: str, args: argparse.Namespace, rc: int, results_path: str | None) -> tuple[int, list[Any] | None]:
    """After pyinfra: the per-host summary and retry line (vllm_fleet.commands.outcome), and
    ``(exit code, results)``."""
    from vllm_fleet.commands.outcome import read_results, report

    results = read_results(results_path) if results_path else None
    return report(command, results, rc, retry_command(args, command)), results


#: The model role's host data that ``deploy --verify`` sets (vllm_fleet/roles/model/defaults.py).
VERIFY_DATA = "model_verify=true"


def hash_models(deployments: list[Deployment], say: Callable[[str], None]) -> None:
    """Hash each ``transfer: upload`` model directory here, before pyinfra connects
    (vllm_fleet.fetch.treehash: only files not hashed before are read; ``say`` is told when any
    is), so the deploy process, and every later one, finds the hashes in the cache."""
    from vllm_fleet.fetch.treehash import hash_tree

    for d in deployments:
        if d.resolved["model"]["transfer"] == "upload":
            hash_tree(d.resolved["model"]["local_dir"], log=say)


def pyinfra_argv(
    inventory: str,
    func: str,
    data: Sequence[str],
    limit: Sequence[str],
    *,
    dry: bool = False,
    diff: bool = False,
    yes: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    from vllm_fleet.specs.inventory import for_pyinfra

    argv = [pyinfra_bin(), for_pyinfra(inventory), func]
    for d in data:
        argv += ["--data", d]
    for h in limit:
        argv += ["--limit", h]
    return argv + (["--dry"] if dry else []) + (["--diff"] if diff else []) + (["-y"] if yes else []) + list(extra)


def summary(deployments: list[Deployment]) -> str:
    return "; ".join(f"{d.resolved['name']} ({os.path.relpath(d.path)}) on {', '.join(d.hosts)}" for d in deployments)


def closing_summary(deployments: list[Deployment], write: bool = True, serving: set[str] | None = None) -> list[str]:
    """What a person needs after a deploy, per deployment: the endpoint, the client settings files
    on this machine (``openai.env`` is written here from the rendered client target when it
    differs; ``openai.json`` by the smoke tests), where the API key is (never the key), and one
    command that tries the service. ``serving``: the hosts the run finished (None: all); a
    deployment none of whose hosts (or none of whose nginx hosts) finished gets one line saying so."""
    import shlex

    from vllm_fleet.render.files import paths
    from vllm_fleet.render.parts import files_of

    out: list[str] = []
    for d in deployments:
        client = d.rendered.get("client") or {}
        p = paths(d.resolved)
        try:
            settings = json.loads(client[p["client_json"]].content)
        except (KeyError, ValueError):
            continue
        if write and p["client_env"] in client:
            env = Path(os.path.expanduser(p["client_env"]))
            want = client[p["client_env"]].content
            try:
                if not env.is_file() or env.read_text() != want:
                    env.parent.mkdir(parents=True, exist_ok=True)
                    env.write_text(want)
            except OSError as exc:
                out.append(f"  (could not write {p['client_env']}: {exc.strerror or exc})")
        files = [f for f in (p["client_json"], p["client_env"]) if Path(os.path.expanduser(f)).is_file()]
        ref = d.resolved["server"].get("api_key") or {}
        if "file" in ref:
            f = ref["file"]
            cat = f'"$(cat {"~/" + shlex.quote(f[2:]) if f.startswith("~/") else shlex.quote(f)})"'
        elif "env" in ref:
            cat = f'"${ref["env"]}"'
        else:
            cat = ""
        auth = f"-H \"Authorization: Bearer {cat[1:-1]}\" " if cat else ""
        base = settings["base_url"]
        # the hosts the layout gives a part of this deployment (a host of the inventory with none
        # of its files, e.g. lab3 as a spare Ray worker of a one-node spec, serves nothing of it)
        parts = [h for h in d.hosts if files_of(d.rendered.get(h, {}), d.resolved["name"])]
        hosts = [h for h in parts if serving is None or h in serving]
        # its nginx hosts in this run (one outside --limit serves as it did)
        proxies = [h for h, files in d.rendered.items() if h in d.hosts and p["nginx_site"] in files]
        if not hosts or (proxies and serving is not None and not set(proxies) & serving):
            out.append(
                f"vllm-fleet deploy: {d.resolved['name']}: not serving at {base}: "
                f"{', '.join(sorted(set(proxies) - (serving or set()) or set(d.hosts)))} did not finish (above)"
            )
            continue
        down = [h for h in parts if h not in hosts]
        out += [
            f"vllm-fleet deploy: {d.resolved['name']} serves {settings['model']!r} on {', '.join(hosts)}"
            + (f" (not on {', '.join(down)}: failed or not attempted)" if down else ""),
            f"  endpoint:  {base}",
            f"  client:    {', '.join(files) if files else '(no client settings file written: smoke tests off?)'}",
            f"  API key:   {settings['api_key']['where']} (never printed)",
            f"  try it:    curl -s {auth}{base}/models",
        ]
    return out


def checked_plan(args: argparse.Namespace, command: str, nothing: str) -> tuple[list[Deployment], list[str]] | None:
    """:func:`plan` for a command's arguments; on bad input every problem printed, then
    ``vllm-fleet COMMAND: NOTHING; no host was contacted``, and None (exit EXIT_INPUT)."""
    try:
        return plan(args.inventory, args.spec, args.data or [], args.limit or [])
    except PlanError as exc:
        for line in exc.lines:
            print(f"vllm-fleet {command}: {line}", file=sys.stderr)
        print(f"vllm-fleet {command}: {nothing}; no host was contacted", file=sys.stderr)
        return None


def checked_before_any_host(
    args: argparse.Namespace, command: str, nothing: str, runner: Callable[[list[str]], int] | None
) -> tuple[list[Any], list[str]] | int:
    """What `deploy` and `down` do before pyinfra: the checks (local: spec, inventory, fleet),
    then, without -y, the refusal to ask on no terminal. ``(deployments, data)``, or the exit code."""
    planned = checked_plan(args, command, nothing)
    if planned is None:
        return EXIT_INPUT
    if runner is None and no_terminal(args, command):  # after the checks (local), before any host
        return EXIT_USAGE
    return planned


def checked_and_warned(
    args: argparse.Namespace, command: str, nothing: str, runner: Callable[[list[str]], int] | None
) -> tuple[list[Any], list[str]] | int:
    """:func:`checked_before_any_host`, then each spec's warnings (allowed but costly, with the fix)
    on stderr: what `deploy` and `stage` open with (`down` removes, and prints none)."""
    planned = checked_before_any_host(args, command, nothing, runner)
    if not isinstance(planned, int):
        for d in planned[0]:
            for w in d.warnings:
                print(f"vllm-fleet {command}: {w}", file=sys.stderr)
    return planned


def cmd_deploy(args: argparse.Namespace, runner: Callable[[list[str]], int] | None = None) -> int:
    planned = checked_and_warned(args, "deploy", "nothing was deployed", runner)
    if isinstance(planned, int):
        return planned
    deployments, data = planned
    print(f"vllm-fleet deploy: valid: {summary(deployments)}", file=sys.stderr)
    hash_models(deployments, lambda m: print(f"vllm-fleet deploy: {m}", file=sys.stderr))
    if getattr(args, "verify", False):
        data = [*data, VERIFY_DATA]
    argv = pyinfra_argv(
        args.inventory,
        DEPLOY,
        data,
        args.limit or [],
        dry=args.dry,
        diff=args.diff,
        yes=args.yes,
        extra=run_flags(args, deployments),
    )
    print(f"vllm-fleet deploy: {' '.join(argv)}", file=sys.stderr)
    results_path = None if runner else results_file()
    rc = run_pyinfra(argv, runner, what="vllm-fleet deploy", again=again_command(args, "deploy"), results=results_path)
    code, results = finish("deploy", args, rc, results_path)
    if code == 130:
        return code
    if not args.dry and code != EXIT_NOTHING_DONE:
        serving = None if results is None else {r.host for r in results if r.status in DONE}
        for line in closing_summary(deployments, serving=serving):
            print(line)
    return code


def run_flags(args: argparse.Namespace, deployments: list[Deployment]) -> list[str]:
    """pyinfra's --fail-percent and --parallel for --max-fail and --parallel over the run's hosts."""
    from vllm_fleet.commands.outcome import pyinfra_run_flags

    hosts = {h for d in deployments for h in d.hosts}
    return pyinfra_run_flags(args, len(hosts), lambda m: print(f"vllm-fleet: {m}", file=sys.stderr))


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    from vllm_fleet.commands.argtypes import add_inventory_arguments

    add_inventory_arguments(p)
    p.add_argument(
        "--spec",
        help="the deployment spec for every host (default: each host's data vllm_fleet_spec, "
        "$VLLM_FLEET_SPEC; the lab inventory: deployments/lab-tiny.yaml)",
    )
    p.add_argument(
        "--limit", action="append", metavar="HOSTS", help="only these hosts or groups (pyinfra's --limit; repeatable)"
    )


def add_cli(sub: Any) -> None:
    from vllm_fleet.commands.outcome import add_run_arguments

    p = sub.add_parser(
        "deploy",
        help="validate, then converge the hosts with pyinfra (docs/own-servers.md)",
        description="Validate the spec(s) against the inventory before any connection, then run pyinfra. "
        "A host that fails leaves the others converging; the run ends with a per-host summary and a "
        "line that retries the failed hosts. " + EXIT_HELP,
    )
    add_fleet_arguments(p)
    add_run_arguments(p)
    p.add_argument("--dry", action="store_true", help="show what would change; change nothing (not even here)")
    p.add_argument("--diff", action="store_true", help="pyinfra's --diff: show file diffs while it runs")
    p.add_argument(
        "--verify",
        action="store_true",
        help="hash every file of an uploaded model on the hosts (model_verify): a converged host is "
        "otherwise judged by the stamp of its last verified copy (sizes, mtimes, ctimes)",
    )
    p.add_argument("-y", "--yes", action="store_true", help="do not ask before changing hosts")
    p.set_defaults(func=cmd_deploy)
