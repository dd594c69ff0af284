"""Running pyinfra for `vllm-fleet deploy|down`: honest exits on Ctrl-C and without a terminal.

pyinfra 3.10's own SIGINT handler prints "Exiting upon user request!" and calls ``sys.exit(0)``
from whatever greenlet is running: a gevent ``LoopExit`` traceback, and exit 0 when the signal
reached pyinfra alone (an interrupted deploy that reports success). Here:

- :func:`install_sigint` replaces that handler with one that prints ONE line (what was
  interrupted, what may still run on the hosts, what to run next) and leaves at once with exit
  130 (``os._exit``: no greenlet is unwound, so no traceback). The packaged deploys call it when
  pyinfra loads them (so a bare ``pyinfra inventory.py deploys/serve.py`` gets it for the run),
  and ``python -m vllm_fleet.host.pyinfra_run`` (what :func:`run` starts) installs it
  before pyinfra's CLI starts (so also while it connects).
- :func:`run` starts pyinfra as a child and, while it runs, takes SIGINT itself (a Ctrl-C in a
  terminal reaches both: the child stops, the parent waits for it and reports), so an interrupted
  run never exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Sequence

EXIT_INTERRUPTED = 130
# what the child says when the parent (vllm-fleet) reports; the parent sets it
_QUIET = "VLLM_FLEET_INTERRUPT_QUIET"

STILL_RUNNING = (
    "a command already started on a host (a pip install, a model download, a health wait) "
    "may still run there to its end; nothing is rolled back"
)


def interrupted_line(what: str, again: str) -> str:
    return (
        f"{what}: interrupted (Ctrl-C): {STILL_RUNNING}. Next: `{again}` converges the hosts again (it is idempotent)"
    )


def _handler(signum, frame) -> None:  # pragma: no cover - exercised by the lab test (a real SIGINT)
    try:
        if not os.environ.get(_QUIET):
            sys.stderr.write("\n" + interrupted_line("pyinfra", "pyinfra " + " ".join(sys.argv[1:])) + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(EXIT_INTERRUPTED)


def install_sigint() -> None:
    """Our SIGINT handler in this process when it is pyinfra's CLI (not pyinfra's API in another
    program, e.g. a test harness); only from the main thread, else nothing."""
    import pyinfra

    if not getattr(pyinfra, "is_cli", False):
        return
    try:
        signal.signal(signal.SIGINT, _handler)
    except ValueError:  # not the main thread
        pass


def main() -> None:  # pragma: no cover - a subprocess
    """``python -m vllm_fleet.host.pyinfra_run ARGS``: pyinfra's CLI with :func:`install_sigint`
    in place from the start (pyinfra's main() sets its own SIGINT handler: it is ignored)."""
    real = signal.signal

    def keep_ours(sig, handler):
        if sig == signal.SIGINT:
            return real(sig, _handler)
        return real(sig, handler)

    signal.signal = keep_ours  # type: ignore[assignment]
    install_sigint()
    from pyinfra_cli.main import main as pyinfra_main

    sys.argv = ["pyinfra", *sys.argv[1:]]
    try:
        pyinfra_main()
    finally:  # pyinfra ends with sys.exit: its per-host results for the parent (vllm_fleet.host.results)
        from vllm_fleet.host.results import write_from_context

        try:
            write_from_context("--dry" in sys.argv)
        except Exception as exc:  # the run's own exit status stands; the parent says it has no results
            sys.stderr.write(f"vllm-fleet: could not write the per-host results: {exc!r}\n")


def child_argv(argv: Sequence[str]) -> list[str]:
    """``pyinfra ARGS`` -> the same run through :func:`main` (this interpreter, pyinfra's CLI)."""
    return [sys.executable, "-m", "vllm_fleet.host.pyinfra_run", *argv[1:]]


def run(argv: Sequence[str], what: str, again: str, env: dict[str, str] | None = None) -> int:
    """Run ``argv`` (``pyinfra ...``) with its output on this terminal; its exit status, or 130
    after a Ctrl-C (one line printed: what may still run on the hosts, what to run next).
    ``env``: the child's environment (default this process's), e.g. with $VLLM_FLEET_RESULTS."""
    seen: list[int] = []
    child: list[subprocess.Popen] = []

    def note(signum, frame):
        seen.append(signum)
        if child and child[0].poll() is None:  # a signal to this process only: pass it on
            child[0].send_signal(signal.SIGINT)

    old = signal.signal(signal.SIGINT, note)
    try:
        proc = subprocess.Popen(child_argv(argv), env={**(os.environ if env is None else env), _QUIET: "1"})
        child.append(proc)
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - the handler above takes it
                seen.append(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, old)
    if seen or rc in (EXIT_INTERRUPTED, -signal.SIGINT):
        print(interrupted_line(what, again), file=sys.stderr)
        return EXIT_INTERRUPTED
    return rc


if __name__ == "__main__":  # pragma: no cover
    main()
