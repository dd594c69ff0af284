"""The one line that says why vLLM died while starting, found in its journal.

When vLLM's engine fails to start, its journal ends with the API server's traceback ("Engine core
initialization failed. See root cause above"), often longer than the tail a deploy shows; the
engine's own error (e.g. "ValueError: Connector OffloadingConnector does not support HMA but HMA is
enabled. Please set `--disable-hybrid-kv-cache-manager`.") is above it, in the block the engine
process logs as ``ERROR ... EngineCore failed to start.`` followed by its traceback.
:func:`root_cause` finds that block's last exception line; without one, the last exception line
of the journal. Pure text: no pyinfra, no host.
"""

from __future__ import annotations

import re

#: vLLM's log prefix: ``(EngineCore_DP0 pid=123) ERROR 12-04 10:00:00 [core.py:708] `` (the
#: process tag is absent in a single-process log), and systemd's ``-o short`` prefix before it.
_PREFIX = re.compile(
    r"^(?:\S+ \d+ [\d:]+ \S+ \S+: )?(?P<proc>\([^)]*pid=\d+\)\s+)?(?:(?P<level>[A-Z]+) [\d-]+ [\d:.]+ \[[^\]]*\]\s?)?"
)
#: An exception line as Python prints it last in a traceback: ``Name: message`` or a bare ``NameError``.
_EXC = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning|Failure|Fault)\b(?::.*)?$")
#: Journal lines a deploy reads after a failed start to find the root cause in (it shows fewer).
JOURNAL_READ = 2000
_START_FAILED = ("EngineCore failed to start", "Engine core initialization failed", "Exception in worker")
#: The API server's own line after the engine died: never the cause itself.
_NOT_CAUSE = ("Engine core initialization failed", "See root cause above")


def _strip(line: str) -> tuple[str, str, str]:
    """``(process tag, level, message)`` of one journal line."""
    m = _PREFIX.match(line)
    proc = (m.group("proc") or "").strip() if m else ""
    level = (m.group("level") or "") if m else ""
    return proc, level, line[m.end() :].strip() if m else line.strip()


def _is_cause(msg: str) -> bool:
    return bool(_EXC.match(msg)) and not any(n in msg for n in _NOT_CAUSE)


def root_cause(lines: list[str]) -> str | None:
    """The engine's root-cause line of a failed start (the last exception line of the last
    ``EngineCore failed to start`` block, from the same process), else the journal's last exception
    line that is not the API server's "see root cause above"; None when there is none."""
    parsed = [_strip(line) for line in lines]
    start = max((i for i, (_, _, msg) in enumerate(parsed) if _START_FAILED[0] in msg), default=None)
    if start is not None:
        proc = parsed[start][0]
        block = [msg for p, _, msg in parsed[start + 1 :] if p == proc]
        found = [msg for msg in block if _is_cause(msg)]
        if found:
            return found[-1]
    found = [msg for _, _, msg in parsed if _is_cause(msg)]
    return found[-1] if found else None


def failure_text(host: str, unit: str, what: str, lines: list[str], shown: int) -> str:
    """A failed start's message: the root cause first, then where the whole journal is, then its
    last ``shown`` lines."""
    cause = root_cause(lines)
    head = f"{host}: {unit} {what}"
    if cause:
        head += f"\n  root cause: {cause}"
    tail = "\n".join(lines[-shown:])
    return (
        f"{head}\n  full journal: journalctl -u {unit} --no-pager (on {host})\n"
        f"Last {min(shown, len(lines))} journal lines:\n{tail}"
    )
