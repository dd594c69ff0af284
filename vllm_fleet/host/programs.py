"""The programs vllm-fleet runs on a host, and the command lines that start them.

Every program that runs on a host (shell or Python) is a file in ``vllm_fleet/host/scripts/``,
none is embedded in a Python string; every command line a role or command sends is a pyinfra
``StringCommand`` whose arguments are ``QuoteString``s (pyinfra quotes them when it runs the
command, and masks nothing by accident):

    argv("mkdir", "-p", path)                     # mkdir -p '/opt/a b'
    python(py, "env_probe.py", "dist:vllm")       # py -c '<env_probe.py>' dist:vllm
    shell("host_state.sh", "stat", "/etc/x")      # sh -c '<host_state.sh>' host-state stat /etc/x
    chain(argv(...), argv(...), op="&&")          # one command line of several
    if_then(argv("test", "-e", p), argv(...))     # if test -e p ; then ... ; fi
    group(argv(...), argv(...))                   # { ... ; ... ; }
    to_file(argv("printf", "%s\\n", v), p)        # printf '%s\n' v > p
    quiet(argv(...)), to_stderr(argv(...))        # ... >/dev/null 2>&1, ... >&2

Roles build their command lines with these alone (tests/roles/test_commands.py forbids a bare
``StringCommand(`` there): a value is never pasted into a line unquoted.

A Python script says ``# vllm-fleet: include NAME`` on a line of its own to have that file of the
same folder put there (``api_key.py``: the one reader of the API key line on a host).

Core module: pyinfra's command types only (no host, no state).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from pyinfra.api import QuoteString, StringCommand

SCRIPTS = Path(__file__).resolve().parent / "scripts"

_INCLUDE = re.compile(r"^# vllm-fleet: include (\S+)$", re.M)


@lru_cache(maxsize=None)
def script(name: str) -> str:
    """The text of ``scripts/NAME``, with its includes put in place."""
    text = (SCRIPTS / name).read_text()
    return _INCLUDE.sub(lambda m: script(m.group(1)).rstrip("\n"), text)


def path(name: str) -> Path:
    """Where ``scripts/NAME`` is on the control machine (to upload it, or run it here)."""
    return SCRIPTS / name


def _bit(a):
    if isinstance(a, (StringCommand, QuoteString)):
        return a
    return QuoteString(str(a))


def argv(*args) -> StringCommand:
    """One command from its arguments, each quoted (a StringCommand/QuoteString stays as it is)."""
    return StringCommand(*(_bit(a) for a in args))


def raw(*bits: str) -> StringCommand:
    """Shell syntax that must not be quoted (``||``, ``2>/dev/null``, ``&&``), as one bit each."""
    return StringCommand(*bits)


def chain(*commands, op: str = "&&") -> StringCommand:
    """Several commands joined by a shell operator (``&&``, ``||``, ``;``)."""
    bits: list = []
    for i, c in enumerate(commands):
        if i:
            bits.append(op)
        bits.append(c if isinstance(c, StringCommand) else _bit(c))
    return StringCommand(*bits)


def if_then(condition, *then) -> StringCommand:
    """``if CONDITION ; then THEN ; ... ; fi``: the commands run only when ``condition`` succeeds,
    and the line succeeds when it does not (unlike ``&&``)."""
    bits: list = ["if", _bit(condition), ";", "then"]
    for c in then:
        bits += [_bit(c), ";"]
    return StringCommand(*bits, "fi")


def group(*commands) -> StringCommand:
    """``{ A ; B ; }``: several commands run as one (the right side of ``||``, say)."""
    bits: list = ["{"]
    for c in commands:
        bits += [_bit(c), ";"]
    return StringCommand(*bits, "}")


def to_file(command, path) -> StringCommand:
    """``COMMAND > PATH``: its output written to ``path`` (quoted)."""
    return StringCommand(_bit(command), ">", QuoteString(str(path)))


def quiet(command, *, out: bool = True, err: bool = True) -> StringCommand:
    """``COMMAND >/dev/null 2>/dev/null``: its standard output (``out``) and/or errors (``err``)
    dropped; ``2>&1`` when both go."""
    bits = [_bit(command)] + ([">/dev/null"] if out else []) + (["2>&1" if out else "2>/dev/null"] if err else [])
    return StringCommand(*bits)


def to_stderr(command) -> StringCommand:
    """``COMMAND >&2``: its output said on standard error."""
    return StringCommand(_bit(command), ">&2")


def with_stderr(command) -> StringCommand:
    """``COMMAND 2>&1``: its errors in its output (one stream to read back)."""
    return StringCommand(_bit(command), "2>&1")


def python(interpreter: str, name: str, *args, isolated: bool = False) -> StringCommand:
    """``INTERPRETER -c <scripts/NAME> ARGS...``: a Python script streamed on the command line."""
    return argv(interpreter, *(["-I"] if isolated else []), "-c", script(name), *args)


def shell(name: str, *args, interpreter: str = "sh") -> StringCommand:
    """``sh -c <scripts/NAME> NAME ARGS...`` (``$0`` is the script's name, ``$1``... its arguments)."""
    return argv(interpreter, "-c", script(name), Path(name).stem.replace("_", "-"), *args)


def text(command) -> str:
    """The command line as the host's shell receives it."""
    return command.get_raw_value() if isinstance(command, StringCommand) else str(command)
