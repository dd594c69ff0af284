"""How a fleet command ends: the per-host summary, the exit code, ``--max-fail`` and the retry line.

One module for every command that changes hosts (`deploy`, `down`, `rollout`, `stage`), so each
ends the same way:

- a per-host summary: ``converged`` (nothing to change), ``changed``, ``failed`` and why (one
  line), ``not attempted`` (the run stopped before the host's operations ran); with ``--dry``
  ``would change`` instead of ``changed``;
- a ready-to-paste line that runs the same command again (same ``--spec``/``--data``) on only the
  failed and not-attempted hosts (pyinfra's ``--limit``, once per host);
- the exit code:

  ====  =====================================================================================
  0     all done: every host converged or changed (``--dry``: the plan was shown)
  1     a problem with the spec, the inventory or a secret: no host was contacted, nothing changed
  2     usage (a bad argument; no terminal to confirm on without ``-y``)
  3     some hosts failed (or were not attempted), the others are done: the summary names them
  4     nothing done: hosts were contacted, but none completed (every host failed, or the run
        stopped, e.g. ``--max-fail`` reached, before any finished)
  130   interrupted (Ctrl-C)
  ====  =====================================================================================

``--max-fail N|P%`` is Ansible's ``max_fail_percentage`` (and a count): the run stops once MORE
than N hosts (P percent of the run's hosts) have failed; a host already failing is never a reason
to stop the others below that. For pyinfra runs it becomes pyinfra's own ``--fail-percent``
(:meth:`MaxFail.fail_percent`: exact below 100 hosts); the rollout counts replicas itself.

Core module: no pyinfra import; the per-host results come from the pyinfra child
(:mod:`vllm_fleet.host.results`, the file ``$VLLM_FLEET_RESULTS`` names).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from vllm_fleet.host.results import (
    CHANGED,
    CONVERGED,
    FAILED,
    NOT_ATTEMPTED,
    RESULTS_ENV,
    STATUSES,
    WOULD_CHANGE,
    HostResult,
    read,
)

EXIT_OK = 0
EXIT_INPUT = 1
EXIT_USAGE = 2
EXIT_SOME_FAILED = 3
EXIT_NOTHING_DONE = 4
EXIT_INTERRUPTED = 130

#: one line each, for --help and the docs (docs/rollout.md, "Exit codes")
EXIT_HELP = (
    "Exit codes: 0 all done (--dry: the plan shown); 1 spec/inventory/secret problem, no host contacted; "
    "2 usage; 3 some hosts failed, the others done (the summary names them, with a retry line); "
    "4 nothing done (every host failed, or the run stopped before any finished); 130 interrupted."
)

DONE = (CONVERGED, CHANGED, WOULD_CHANGE)
__all__ = [
    "CHANGED",
    "CONVERGED",
    "FAILED",
    "NOT_ATTEMPTED",
    "WOULD_CHANGE",
    "HostResult",
    "MaxFail",
    "parse_max_fail",
    "exit_code",
    "summary_lines",
    "retry_line",
    "report",
    "add_run_arguments",
    "pyinfra_run_flags",
    "results_file",
]


@dataclass(frozen=True)
class MaxFail:
    """How many failed hosts (or replicas) a run goes on with: ``count``, or ``percent`` of them."""

    count: int | None = None
    percent: int | None = None

    def __str__(self) -> str:
        return f"{self.percent}%" if self.percent is not None else str(self.count)

    def exceeded(self, failed: int, total: int) -> bool:
        """True when ``failed`` of ``total`` is more than allowed (the run must stop)."""
        if self.percent is not None:
            return total > 0 and failed * 100 > self.percent * total
        return failed > (self.count or 0)

    def fail_percent(self, total: int) -> tuple[int, bool]:
        """``(pyinfra's --fail-percent, exact)`` for a run of ``total`` hosts. pyinfra stops when
        ``100 * failed / total > fail_percent`` (a whole number); a count N becomes the largest
        whole percent below N+1's share, exact when every share of one host exceeds 1 % (fewer than
        100 hosts); else the smallest at or above N's share (a few more may fail: ``exact`` False)."""
        if self.percent is not None:
            return self.percent, True
        n = self.count or 0
        if total <= 0 or n >= total:
            return 100, True
        q = math.ceil(100 * (n + 1) / total) - 1
        if q - 100 * n / total >= 1e-6:
            return q, True
        return math.ceil(100 * n / total), False


_MAX_FAIL = re.compile(r"\s*([0-9]+)\s*(%?)\s*")


def parse_max_fail(text: str) -> MaxFail:
    """``N`` (hosts) or ``P%`` (whole percent, 0-100): an argparse type (a bad value: exit 2)."""
    m = _MAX_FAIL.fullmatch(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of hosts (e.g. 2) or a whole percentage (e.g. 10%)")
    n = int(m.group(1))
    if m.group(2):
        if n > 100:
            raise argparse.ArgumentTypeError(f"{text!r}: a percentage is at most 100%")
        return MaxFail(percent=n)
    return MaxFail(count=n)


parse_max_fail.__name__ = "max-fail"  # argparse's "invalid max-fail value"


def add_run_arguments(
    p: argparse.ArgumentParser, *, max_fail_default: str | None = None, parallel: bool = True
) -> None:
    """``--max-fail`` (and ``--parallel``, pyinfra's) on a command's parser."""
    p.add_argument(
        "--max-fail",
        type=parse_max_fail,
        default=parse_max_fail(max_fail_default) if max_fail_default else None,
        metavar="N|P%",
        help="stop once more than N hosts (P%% of them) have failed; the others go on below that "
        "(Ansible's max_fail_percentage; pyinfra's --fail-percent)"
        + (
            f"; default {max_fail_default}"
            if max_fail_default
            else "; default: no limit, every host that can converges"
        ),
    )
    if parallel:
        from vllm_fleet.commands.argtypes import count

        p.add_argument(
            "--parallel",
            type=count(1, 100_000),
            metavar="N",
            help="pyinfra's --parallel: hosts worked on at once (default: pyinfra's, every host up to its limit)",
        )


def pyinfra_run_flags(args: argparse.Namespace, hosts: int, say: Callable[[str], None] | None = None) -> list[str]:
    """pyinfra's ``--fail-percent`` / ``--parallel`` for ``--max-fail`` / ``--parallel`` over a run of
    ``hosts`` hosts (``say`` is told when a count cannot be exact)."""
    out: list[str] = []
    mf: MaxFail | None = getattr(args, "max_fail", None)
    if mf is not None:
        q, exact = mf.fail_percent(hosts)
        if not exact and say:
            say(
                f"--max-fail {mf} of {hosts} hosts: pyinfra counts whole percents; it stops past {q}% "
                f"({math.floor(q * hosts / 100)} hosts)"
            )
        out += ["--fail-percent", str(q)]
    if getattr(args, "parallel", None):
        out += ["--parallel", str(args.parallel)]
    return out


def exit_code(results: Sequence[HostResult] | None, rc: int = 0) -> int:
    """The command's exit code from the per-host results and the run's own exit status ``rc``
    (None results: the run wrote none, e.g. it stopped before it had any)."""
    if rc == EXIT_INTERRUPTED:
        return EXIT_INTERRUPTED
    if results is None:
        return EXIT_OK if rc == 0 else EXIT_SOME_FAILED
    done = sum(r.status in DONE for r in results)
    if results and done == len(results):
        return EXIT_OK if rc == 0 else EXIT_SOME_FAILED
    return EXIT_SOME_FAILED if done else EXIT_NOTHING_DONE


def retry_hosts(results: Iterable[HostResult]) -> list[str]:
    """The hosts to run again: failed, then not attempted (each in the run's order)."""
    results = list(results)
    return [r.host for r in results if r.status == FAILED] + [r.host for r in results if r.status == NOT_ATTEMPTED]


def retry_line(
    command: str, positional: Sequence[str], options: Sequence[tuple[str, str | None]], hosts: Sequence[str]
) -> str:
    """``vllm-fleet COMMAND POSITIONAL... OPTIONS... --limit H ... `` on ``hosts`` only, quoted for a
    shell. ``options``: ``(flag, value)`` pairs as the user gave them (value None: a bare flag,
    put last); their ``--limit`` is replaced by the hosts."""
    out = ["vllm-fleet", command, *positional]
    flags: list[str] = []
    for flag, value in options:
        if flag == "--limit":
            continue
        if value is None:
            flags.append(flag)
        else:
            out += [flag, value]
    for h in hosts:
        out += ["--limit", h]
    return " ".join(shlex.quote(a) for a in out + flags)


def summary_lines(
    command: str, results: Sequence[HostResult], retry: str | None = None, unit: str = "host"
) -> list[str]:
    """The per-host summary (failed hosts one per line with why; the others grouped by status),
    then the retry line when a host failed or was not attempted."""
    by: dict[str, list[HostResult]] = {s: [] for s in STATUSES}
    for r in results:
        by.setdefault(r.status, []).append(r)
    counts = ", ".join(f"{len(v)} {k}" for k, v in by.items() if v or k in (CONVERGED, CHANGED, FAILED))
    lines = [f"vllm-fleet {command}: {len(results)} {unit}(s): {counts}"]
    for r in by[FAILED]:
        lines.append(f"  failed:        {r.host}: {r.reason or 'see the output above'}")
    if by[NOT_ATTEMPTED]:
        why = sorted({r.reason for r in by[NOT_ATTEMPTED] if r.reason})
        lines.append(
            f"  not attempted: {', '.join(r.host for r in by[NOT_ATTEMPTED])}" + (f" ({'; '.join(why)})" if why else "")
        )
    for status in (CHANGED, WOULD_CHANGE, CONVERGED):
        if by[status]:
            lines.append(f"  {status + ':':<14} {', '.join(r.host for r in by[status])}")
    if retry and (by[FAILED] or by[NOT_ATTEMPTED]):
        lines.append(f"  retry only those: {retry}")
    return lines


def report(
    command: str,
    results: Sequence[HostResult] | None,
    rc: int,
    retry: Callable[[list[str]], str] | None = None,
    say: Callable[[str], None] | None = None,
    unit: str = "host",
) -> int:
    """End a run: the per-host summary (with ``retry(hosts)``'s line when hosts failed) told to
    ``say`` (default: stderr), and the exit code (:func:`exit_code`)."""
    import sys

    say = say or (lambda m: print(m, file=sys.stderr))
    if rc == EXIT_INTERRUPTED:
        return EXIT_INTERRUPTED
    if results is None:
        if rc != 0:
            say(f"vllm-fleet {command}: pyinfra exited {rc} and left no per-host results: see its output above")
        return exit_code(None, rc)
    again = retry_hosts(results)
    for line in summary_lines(command, results, retry(again) if retry and again else None, unit):
        say(line)
    return exit_code(results, rc)


def results_file() -> str:
    """A fresh path for a pyinfra child's results (:data:`RESULTS_ENV`); the caller removes it."""
    fd, path = tempfile.mkstemp(prefix="vllm-fleet-results-", suffix=".json")
    os.close(fd)
    os.unlink(path)  # the child writes it; none there = the child wrote no results
    return path


def read_results(path: str) -> list[HostResult] | None:
    """The child's results (None: it wrote none), and the file removed."""
    try:
        return read(path)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def with_results(env: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """The environment for a pyinfra child that writes its results to ``path``."""
    return {**(os.environ if env is None else env), RESULTS_ENV: path}
