"""Rolling update of the replicas behind one nginx: `vllm-fleet rollout INVENTORY --spec SPEC`.

The replicas are the deployment's vLLM instances as the layout (:mod:`vllm_fleet.render.layout`) puts
them on the inventory: ``HOST:N``, hosts in inventory order, then by index; batches of
``--batch-size`` instances (or ``--batch-percent``, or the spec's ``rollout`` section).
For each batch, each step a run of the packaged deploy ``vllm_fleet.deploys.rollout:rollout_step``
(what the checkout's ``deploys/rollout.py`` calls) through pyinfra (``--limit``):

1. ``upstream`` on the proxy hosts: the batch marked ``down`` in the nginx upstream, ``nginx -t``,
   reload, wait until the old nginx workers (which finish in-flight requests, and for a moment
   still take new ones) have exited;
2. ``update`` on the batch's hosts (only the batch's instances are restarted): wait until each
   reports no running/waiting request, then the serve deploy's server part (restart when what it
   runs changed, wait for /health), then a smoke test of each instance itself;
3. ``upstream`` on the proxy hosts: the batch back in.

The first failed step stops the rollout (``--max-fail N|P%``: only once more than N replicas,
P percent of them, failed; replicas of a failed host stay out of the upstream and the next
batches go on): the failed replicas stay out of the upstream, the replicas not yet updated keep
serving the old configuration. The run ends with a per-replica summary, a line that retries the
failed ones (``--limit`` their hosts) and the exit codes of :mod:`vllm_fleet.commands.outcome`: 0
all updated, 1 bad spec/inventory (no host changed), 3 some replicas failed, 4 none updated. A later
rollout of the same deployment (from this machine) starts with the replicas a failed one left out.
pyinfra's own ``--serial`` order is arbitrary: the order here is the inventory's. Never more than
one batch is out of the upstream (plus those a failed rollout left out, which serve nothing).

Core module: no pyinfra import; pyinfra runs as a subprocess, the way a user runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from vllm_fleet.commands.outcome import CHANGED, CONVERGED, FAILED, NOT_ATTEMPTED, HostResult, MaxFail
from vllm_fleet.host.rollout_step import failure_tail, run_step, step_command
from vllm_fleet.specs.inventory import for_pyinfra, spec_for

STATE_DIR = "~/.cache/vllm-fleet/rollout"  # per deployment: <name>.json (replicas left out) and logs


class RolloutError(Exception):
    """The rollout cannot start (bad arguments, spec or inventory); no host was changed."""


def batch_size(replicas: int, size: int | None = None, percent: float | None = None) -> int:
    """Replicas per batch: ``size``, else ``percent`` of the replicas rounded down (at least 1)."""
    if replicas < 1:
        raise RolloutError("no replicas")
    if size is not None and percent is not None:
        raise RolloutError("give a batch size or a batch percentage, not both")
    if size is not None:
        if size < 1:
            raise RolloutError(f"batch size {size}: must be at least 1")
        n = size
    elif percent is not None:
        if not 0 < percent <= 100:
            raise RolloutError(f"batch percentage {percent}: must be in (0, 100]")
        n = max(1, math.floor(replicas * percent / 100))
    else:
        n = 1
    if n >= replicas:
        raise RolloutError(
            f"a batch of {n} of {replicas} replica(s) would take every replica out of the upstream "
            f"(the service would stop): use a batch of at most {replicas - 1}"
            + ("" if replicas > 1 else "; with one replica, redeploy with deploys/serve.py (it restarts in place)")
        )
    return n


def plan_batches(servers: list[str], size: int, first: list[str] | None = None) -> list[list[str]]:
    """Ordered batches: the replicas a failed rollout left out first (in one batch, they serve
    nothing), then the others in inventory order, ``size`` at a time."""
    first = [s for s in servers if s in set(first or [])]
    rest = [s for s in servers if s not in first]
    batches = [first] if first else []
    batches += [rest[i : i + size] for i in range(0, len(rest), size)]
    return batches


def server_order(
    inventory_path: str, spec: dict[str, Any] | None = None, data: Sequence[str] = ()
) -> tuple[list[str], list[str], dict[str, dict[str, Any]]]:
    """(instance ids ``HOST:N`` in the layout's order, proxy hosts, {host: {address, groups, data}})."""
    from vllm_fleet.specs.inventory import load_inventory
    from vllm_fleet.render.layout import LayoutError, build

    hosts = load_inventory(inventory_path, data)
    if spec is None:
        raise RolloutError("server_order needs the resolved spec")
    try:
        layout = build([spec], hosts)
    except LayoutError as exc:
        raise RolloutError(f"{inventory_path}: {exc}") from None
    return (
        [i.id for i in layout.instances(spec["name"]) if i.role == "server"],
        layout.hosts_with("proxy", spec["name"]),
        hosts,
    )


def _host_of(instance: str) -> str:
    return instance.rsplit(":", 1)[0]


@dataclass
class Step:
    batch: int
    step: str
    hosts: list[str]
    ok: bool
    seconds: float
    detail: str = ""
    #: host -> status from the pyinfra child's results (vllm_fleet.host.results); empty: none written
    results: dict[str, str] = field(default_factory=dict)
    #: host -> why it failed, from the same results (one line: "could not connect ...", the
    #: NoSpace or health-wait message of that host), for its replicas' line in the summary
    reasons: dict[str, str] = field(default_factory=dict)


@dataclass
class RolloutResult:
    name: str
    batches: list[list[str]]
    steps: list[Step] = field(default_factory=list)
    ok: bool = False
    failed_batch: int | None = None
    left_out: list[str] = field(default_factory=list)
    seconds: float = 0.0
    log_dir: str = ""
    #: per replica (``HOST:N``): converged / changed / failed (why) / not attempted
    replicas: list[HostResult] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _noted(text: str) -> list[str]:
    """The drain/smoke lines the rollout role writes through host.noop (pyinfra prints them)."""
    out = []
    for line in text.splitlines():
        if re.search(
            r"(nginx reloaded; old workers|WARNING drain|drain: no running|drain: vLLM|PASS replica|healthy after)",
            line,
        ):
            out.append(re.sub(r"\x1b\[[0-9;]*m", "", line).strip())
    return out


class Rollout:
    """One rollout: call :meth:`run`. ``runner(argv, env) -> (returncode, output)`` runs pyinfra
    (a subprocess by default; tests may pass their own)."""

    def __init__(
        self,
        inventory: str,
        spec_path: str,
        *,
        size: int | None = None,
        percent: float | None = None,
        drain_timeout: float | None = None,
        pyinfra: str | None = None,
        cwd: str | None = None,
        state_dir: str = STATE_DIR,
        say: Callable[[str], None] = print,
        runner: Callable[[list[str], dict[str, str]], tuple[int, str]] | None = None,
        data: Sequence[str] = (),
        max_fail: MaxFail | None = None,
        limit: Sequence[str] = (),
    ):
        from vllm_fleet.specs.pipeline import load_checked
        from vllm_fleet.specs.load import SpecError

        self.inventory, self.spec_path, self.say, self.data = inventory, spec_path, say, list(data)
        try:
            self.spec, _, _ = load_checked(spec_path)
        except SpecError as exc:
            text = "\n".join(f"  {p.format()}" for p in exc.problems if p.severity == "error")
            raise RolloutError(f"{spec_path}: the spec has errors:\n{text}") from None
        ro = self.spec["rollout"]
        if self.spec["parallel"]["nodes"] > 1:
            raise RolloutError(
                f"{spec_path}: parallel.nodes is {self.spec['parallel']['nodes']}: a rollout replaces single-node "
                "replicas"
            )
        if not self.spec["proxy"]["enabled"]:
            raise RolloutError(
                f"{spec_path}: proxy.enabled is false: a rollout takes replicas out of the nginx upstream, there is "
                "none"
            )
        try:
            self.servers, self.proxies, self.hosts = server_order(inventory, self.spec, self.data)
        except RolloutError:
            raise
        except Exception as exc:  # InventoryError, or a user file that fails
            raise RolloutError(str(exc)) from None
        if not self.servers:
            raise RolloutError(f"{inventory}: no vLLM instance of {self.spec['name']} (a host in the `servers` group)")
        if size is None and percent is None:
            percent = ro.get("batch_percent")
            size = None if percent is not None else ro["batch_size"]
        self.size = batch_size(len(self.servers), size, percent)
        self.all_servers = list(self.servers)  # what "every replica out of the upstream" counts
        if limit:  # pyinfra's --limit: group names or globs of host names (the retry line's)
            from vllm_fleet.commands.deploy import PlanError, select

            try:
                hosts = select(self.hosts, list(limit))
            except PlanError as exc:
                raise RolloutError("; ".join(exc.lines)) from None
            self.servers = [s for s in self.servers if _host_of(s) in hosts]
            if not self.servers:
                raise RolloutError(f"--limit {','.join(limit)}: no replica of {self.spec['name']} on those hosts")
        self.max_fail = max_fail or MaxFail(count=0)  # default: the first failure stops the rollout
        self.drain_timeout = float(drain_timeout if drain_timeout is not None else ro["drain_timeout"])
        self.state_dir = Path(os.path.expanduser(state_dir))
        self.state_file = self.state_dir / f"{self.spec['name']}.json"
        left = self._left_out()
        self.batches = plan_batches(self.servers, self.size, left)
        self.pyinfra = pyinfra or str(Path(sys.executable).parent / "pyinfra")
        self.cwd = cwd or os.getcwd()
        self.runner = runner or self._subprocess

    # -- state of an earlier failed rollout ----------------------------------------------------

    def _left_out(self) -> list[str]:
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return []
        return [h for h in data.get("left_out", []) if h in self.servers]

    def _save_left_out(self, hosts: list[str]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if hosts:
            self.state_file.write_text(
                json.dumps(
                    {
                        "left_out": hosts,
                        "spec": os.path.abspath(self.spec_path),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    },
                    indent=2,
                )
                + "\n"
            )
        elif self.state_file.exists():
            self.state_file.unlink()

    # -- running pyinfra ----------------------------------------------------------------------

    def _subprocess(self, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        from vllm_fleet.host.pyinfra_run import child_argv

        return run_step(child_argv(argv), env, cwd=self.cwd)  # pyinfra's CLI, writing its per-host results

    def _step(
        self,
        result: RolloutResult,
        index: int,
        step: str,
        limit: list[str],
        down: list[str],
        log: Path,
        update: list[str] | None = None,
    ) -> Step:
        argv, env = step_command(
            self.pyinfra,
            for_pyinfra(self.inventory),
            self.spec_path,
            step,
            limit=limit,
            down=down,
            drain_timeout=self.drain_timeout,
            update=update,
            data=self.data,
        )
        from vllm_fleet.commands.outcome import read_results, results_file, with_results

        path = results_file()
        t0 = time.monotonic()
        rc, out = self.runner(argv, with_results(env, path))
        seconds = time.monotonic() - t0
        got = read_results(path) or []
        results = {r.host: r.status for r in got}
        reasons = {r.host: r.reason for r in got if r.status == FAILED and r.reason}
        with log.open("a") as f:
            f.write(
                f"\n===== batch {index} step {step} on {','.join(limit)} (down: {','.join(down) or '-'}): rc {rc}, "
                f"{seconds:.1f} s\n{out}"
            )
        s = Step(
            index,
            step,
            list(limit),
            rc == 0,
            round(seconds, 1),
            "; ".join(_noted(out)) if rc == 0 else failure_tail(out),
            results,
            reasons,
        )
        result.steps.append(s)
        return s

    # -- the rollout ----------------------------------------------------------------------------

    def run(self) -> RolloutResult:
        name = self.spec["name"]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_dir = self.state_dir / f"{name}-{stamp}"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / "pyinfra.log"
        result = RolloutResult(name, self.batches, log_dir=str(log_dir))
        t0 = time.monotonic()
        n = len(self.batches)
        self.say(
            f"rollout {name}: {len(self.servers)} replica(s) {', '.join(self.servers)}; "
            f"{n} batch(es): {' | '.join(','.join(b) for b in self.batches)}; proxy {', '.join(self.proxies)}; "
            f"drain at most {self.drain_timeout:.0f} s; stop once more than {self.max_fail} replica(s) failed; log "
            f"{log}"
        )
        out: list[str] = []  # replicas of this run that failed: they stay out of the upstream
        done: dict[str, HostResult] = {}
        stopped = ""

        def step(
            i: int, label: str, what: str, kind: str, limit: list[str], down: list[str], update: list[str] | None = None
        ) -> Step:
            s = self._step(result, i, kind, limit, down, log, update=update)
            self.say(
                f"  {label}: {what}: {'ok' if s.ok else 'FAILED'} in {s.seconds:.1f} s"
                + (f" ({s.detail})" if s.ok and s.detail else "")
            )
            return s

        def finished(r: str, s: Step) -> HostResult:
            return HostResult(r, CONVERGED if s.results.get(_host_of(r)) == CONVERGED else CHANGED)

        def nginx_failed(
            i: int, batch: list[str], what: str, failed: list[str], s: Step, why: str, out: list[str]
        ) -> tuple[list[str], str]:
            """The nginx change on the proxies failed (taking ``batch`` out of the upstream, or putting
            it back): the replicas ``failed`` are FAILED (``why``: the step's detail), the whole batch
            stays out, the failure is explained; the rollout stops. (the replicas out, why it stopped)"""
            for r in failed:
                done[r] = HostResult(r, FAILED, f"{why}: {_one_line(s.detail)}")
            result.left_out = out + batch
            self._explain_failure(result, i, what, batch, s, log)
            return result.left_out, f"the nginx change on {', '.join(self.proxies)} failed"

        for i, batch in enumerate(self.batches, start=1):
            label = f"batch {i}/{n} ({', '.join(batch)})"
            if out and len(set(out) | set(batch)) >= len(self.all_servers):
                stopped = f"batch {i} would take every replica out of the upstream, with the failed ones"
                self.say(f"  {label}: not started: {stopped}")
                break
            batch_hosts = list(dict.fromkeys(_host_of(b) for b in batch))
            s = step(i, label, "out of the upstream", "upstream", self.proxies, out + batch)
            if not s.ok:  # nginx on the proxy: every replica's problem, never one to go past
                why = f"taking it out of the upstream on {', '.join(self.proxies)} failed"
                out, stopped = nginx_failed(i, batch, "out of the upstream", batch, s, why, out)
                break
            s = step(i, label, "drain, update, check", "update", batch_hosts, out + batch, update=batch)
            bad: list[str] = []
            if not s.ok:  # the replicas of the hosts pyinfra failed (the whole batch when it wrote no results)
                failed_hosts = (
                    {h for h, st in s.results.items() if st not in (CHANGED, CONVERGED)}
                    if s.results
                    else set(batch_hosts)
                )
                bad = [r for r in batch if _host_of(r) in failed_hosts] or list(batch)
            for r in batch:  # each failed replica with its own host's reason (a batch holds several hosts)
                why = s.reasons.get(_host_of(r)) or _one_line(s.detail)
                done[r] = HostResult(r, FAILED, f"drain, update, check failed: {why}") if r in bad else finished(r, s)
            good = [r for r in batch if r not in bad]
            if good:
                back = step(i, label, "back into the upstream", "upstream", self.proxies, out + bad)
                if not back.ok:
                    why = "updated, but putting it back into the upstream failed"
                    out, stopped = nginx_failed(i, batch, "back into the upstream", good, back, why, out)
                    break
            if bad:
                out = out + bad
                result.failed_batch = result.failed_batch or i
                fatal = self.max_fail.exceeded(len(out), len(self.servers))
                self._save_left_out(out)
                result.left_out = out
                self._explain_failure(result, i, "drain, update, check", bad, s, log, stopped=fatal)
                if fatal:
                    stopped = f"more than {self.max_fail} replica(s) failed"
                    break
                self.say(
                    f"  {len(out)} of {len(self.servers)} replica(s) failed, within --max-fail {self.max_fail}: "
                    f"{', '.join(out)} stay out of the upstream; the rollout goes on"
                )
        if out and result.failed_batch is None:
            result.failed_batch = i
        result.left_out = out
        result.replicas = [
            done.get(r) or HostResult(r, NOT_ATTEMPTED, f"the rollout stopped ({stopped})" if stopped else "")
            for r in self.servers
        ]
        result.ok = not out and not stopped
        result.seconds = round(time.monotonic() - t0, 1)
        self._save_left_out(out)
        if result.ok:
            self.say(f"rollout {name}: done, {len(self.servers)} replica(s) in {n} batch(es) in {result.seconds:.1f} s")
        elif stopped and not out:
            self.say(f"rollout {name}: stopped: {stopped}")
        return result

    def _explain_failure(
        self, result: RolloutResult, i: int, what: str, batch: list[str], s: Step, log: Path, stopped: bool = True
    ) -> None:
        out = set(result.left_out) | set(batch)  # this run's failed replicas, out of the upstream
        done = [h for b in self.batches[: i - 1] for h in b if h not in out]
        untouched = [h for b in self.batches[i:] for h in b]
        serving = [h for h in self.servers if h not in out]
        inv, spec = self.inventory, self.spec_path
        port = self.spec["server"]["port"]
        lines = [
            f"rollout {result.name}: batch {i}/{len(self.batches)} ({', '.join(batch)}) FAILED at `{what}`; "
            + ("the rollout stopped." if stopped else f"the rollout goes on (--max-fail {self.max_fail})."),
            "  what failed:",
            *("    " + line for line in s.detail.splitlines()),
        ]
        if what == "out of the upstream":
            lines.append(
                f"  the nginx change on {', '.join(self.proxies)} failed (nginx -t or reload): the upstream is as it "
                f"was, or has {', '.join(batch)} out; {', '.join(batch)} were not updated."
            )
        else:
            lines.append(
                f"  {', '.join(batch)}: left OUT of the nginx upstream (marked down on {', '.join(self.proxies)})."
            )
        lines += [
            f"  serving: {', '.join(serving) or 'nothing!'} (updated: {', '.join(done) or 'none'}; "
            f"not yet updated, old configuration: {', '.join(untouched) or 'none'})",
            "  look:",
            *(
                f"    ssh {self.hosts.get(_host_of(h), {}).get('address', _host_of(h))} sudo journalctl -u "
                f"vllm-{result.name}-{h.rsplit(':', 1)[-1]}.service -n 100 --no-pager"
                for h in batch
            ),
            f"    ssh {self.hosts.get(_host_of(batch[0]), {}).get('address', _host_of(batch[0]))} curl -s "
            f"127.0.0.1:{port + int(batch[0].rsplit(':', 1)[-1])}/health; full log: {log}",
            "  then either:",
            f"    fix the spec and run again:  vllm-fleet rollout {inv} --spec {spec}",
            f"    (it updates {', '.join(batch)} first; they stay out of the upstream until they pass)",
            f"    or roll back:                vllm-fleet rollout {inv} --spec <the previous spec>",
        ]
        self.say("\n".join(lines))


def _one_line(text: str) -> str:
    """The first line of a failed step's output that says why (else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    why = [ln for ln in lines if re.search(r"Error|error:|FAIL|not healthy", ln)]
    line = (why or lines or [""])[-1 if not why else 0]
    line = re.sub(r"^(\[[^]]+\]\s*)?([A-Za-z]+Error:\s*)?", "", line)
    return line if len(line) <= 240 else line[:237] + "..."


def format_table(result: RolloutResult) -> str:
    rows = [("batch", "step", "hosts", "ok", "seconds")]
    for s in result.steps:
        rows.append((str(s.batch), s.step, ",".join(s.hosts), "yes" if s.ok else "NO", f"{s.seconds:.1f}"))
    w = [max(len(r[c]) for r in rows) for c in range(5)]
    return "\n".join("  ".join(r[c].ljust(w[c]) for c in range(5)) for r in rows)


def cmd_rollout(args: argparse.Namespace) -> int:
    from vllm_fleet.commands.outcome import EXIT_INPUT, report, retry_line

    try:  # --spec, else the inventory's (vllm_fleet.specs.source): one spec for all replicas
        spec = spec_for(args.inventory, args.spec, args.data or [])
    except ValueError as exc:
        print(f"vllm-fleet rollout: {exc}; no host was changed", file=sys.stderr)
        return EXIT_INPUT
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    try:
        ro = Rollout(
            args.inventory,
            spec,
            size=args.batch_size,
            percent=args.batch_percent,
            drain_timeout=args.drain_timeout,
            data=args.data or [],
            say=say,
            max_fail=getattr(args, "max_fail", None),
            limit=getattr(args, "limit", None) or [],
        )
    except RolloutError as exc:
        print(f"vllm-fleet rollout: {exc}; no host was changed", file=sys.stderr)
        return EXIT_INPUT
    if args.dry:
        return _dry(ro, args)
    result = ro.run()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(format_table(result))
    options = [("--spec", args.spec)] if args.spec else []
    options += [("--data", d) for d in args.data or []]
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--batch-percent", args.batch_percent),
        ("--drain-timeout", args.drain_timeout),
        ("--max-fail", getattr(args, "max_fail", None)),
    ):
        if value is not None:
            options.append((flag, f"{value:g}" if isinstance(value, float) else str(value)))

    def retry(replicas: list[str]) -> str:  # --limit their hosts (a batch is instances, a limit hosts)
        return retry_line("rollout", [args.inventory], options, list(dict.fromkeys(_host_of(r) for r in replicas)))

    return report("rollout", result.replicas, 0 if result.ok else 1, retry, say=say, unit="replica")


def _dry(ro: Rollout, args: argparse.Namespace) -> int:
    """The batches, and per batch what its update would change on its replicas (`vllm-fleet diff`'s
    files and units, read over SSH; nothing is changed)."""
    from vllm_fleet.commands.deploy import PlanError, plan
    from vllm_fleet.commands.diff import diff_files, format_diff

    try:
        deployments, _ = plan(ro.inventory, ro.spec_path, ro.data)
    except PlanError as exc:
        print("\n".join(f"vllm-fleet rollout: {line}" for line in exc.lines), file=sys.stderr)
        return 1
    # a batch is instances (HOST:N): the diff is of their hosts
    per_batch = [diff_files(deployments, hosts=sorted({i.rsplit(':', 1)[0] for i in b})) for b in ro.batches]
    if args.json:
        print(
            json.dumps(
                {
                    "replicas": ro.servers,
                    "proxies": ro.proxies,
                    "batches": ro.batches,
                    "changes": [
                        {hd.host: sorted({f.path for f in hd.files}) + hd.units for hd in diffs} for diffs in per_batch
                    ],
                },
                indent=2,
            )
        )
    else:
        for i, (b, diffs) in enumerate(zip(ro.batches, per_batch), start=1):
            print(f"batch {i}: {', '.join(b)}")
            print("  " + format_diff(diffs).replace("\n", "\n  "))
    return 2 if any(hd.error for diffs in per_batch for hd in diffs) else 0


def add_cli(sub: Any) -> None:
    p = sub.add_parser("rollout", help="rolling update of the replicas behind nginx, batch by batch (docs/rollout.md)")
    from vllm_fleet.commands.argtypes import INVENTORY_HELP, add_inventory_arguments

    add_inventory_arguments(
        p, INVENTORY_HELP + "; replicas: the deployment's instances on its `servers` hosts, in order"
    )
    p.add_argument(
        "--spec",
        help=(
            "the new deployment spec (default: the inventory's data vllm_fleet_spec, $VLLM_FLEET_SPEC; the lab: "
            "deployments/lab-tiny.yaml)"
        ),
    )
    from vllm_fleet.commands.argtypes import count, number

    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--batch-size", type=count(1, 10_000), help="instances per batch (default: the spec's rollout.batch_size, 1)"
    )
    g.add_argument(
        "--batch-percent", type=number(0, 100), help="replicas per batch as a percentage, rounded down, at least 1"
    )
    p.add_argument(
        "--drain-timeout",
        type=number(0, 86400, lo_open=False),
        help="seconds to wait for in-flight requests (default: rollout.drain_timeout)",
    )
    from vllm_fleet.commands.outcome import EXIT_HELP, add_run_arguments

    add_run_arguments(p, max_fail_default="0", parallel=False)
    p.add_argument(
        "--limit",
        action="append",
        metavar="HOSTS",
        help="only the replicas on these hosts or groups (pyinfra's --limit; repeatable): the retry line's",
    )
    p.description = (
        "Replicas updated batch by batch behind nginx; the first failure stops the rollout (--max-fail: "
        "once more than N replicas failed). " + EXIT_HELP
    )
    p.add_argument(
        "--dry",
        action="store_true",
        help="print the batches and what each would change (vllm-fleet diff's files; nothing is changed)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (progress goes to stderr)")
    p.set_defaults(func=cmd_rollout)
