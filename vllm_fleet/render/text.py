"""The text of rendered files: :class:`RenderedFile`, :class:`RenderError`, the header every file
carries, and the quoting that keeps a spec value one token of systemd, nginx or an
EnvironmentFile (:func:`systemd_command`, :func:`nginx_quote`, :func:`env_file`).

The bottom of vllm_fleet.render: the file builders (render/files.py), monitoring's
(render/monitoring) and the secrets' (render/secrets.py) all take these from here; it imports
nothing of vllm_fleet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

HEADER = "Rendered by vllm-fleet for deployment {name}: edit the spec, not this file (the next deploy overwrites it)."


@dataclass(frozen=True)
class RenderedFile:
    """One file to place on a host: exact content, mode, owner and group, and who places it.

    ``owner``/``group`` are empty for files on the control machine (target ``client``): they
    belong to whoever runs vllm-fleet.

    ``deployment`` and ``part`` say whose file it is: the deployment, and the part of it whose role
    places the file (``service``, ``ray``, ``nginx``, ``router``, ``monitoring``, ``client``;
    the part names of vllm_fleet.render.files.PARTS). ``deployment`` is empty for a host-wide file
    over every deployment there (the API firewall). The layout sets both when it renders
    (vllm_fleet.render.files); a role places exactly ``HostLayout.files_of(deployment, part)``. They
    are not part of the file's equality: the same bytes are the same file on the host.
    """

    content: str
    mode: int
    owner: str = "root"
    group: str = "root"
    deployment: str = field(default="", compare=False)
    part: str = field(default="", compare=False)


class RenderError(ValueError):
    """The spec and the inventory do not describe a deployable layout (says what to change)."""


class EnvRef(str):
    """An argv element that systemd expands from the unit's environment: ``${NAME}``."""


# ---------------------------------------------------------------------------------------------
# Formatting helpers

_SAFE_ARG = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_SAFE_ENV_VALUE = re.compile(r"[A-Za-z0-9_@+=:,./|-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SAFE_NGINX = re.compile(r"[A-Za-z0-9_@+=:,./*~-]+")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _one_line(value: str, what: str) -> str:
    if _CONTROL.search(value):
        raise RenderError(f"{what}: {value!r} holds a control character; a value must be one line")
    return value


def comment_text(value: Any) -> str:
    """User input inside a comment line: printable ASCII as is, anything else escaped (a newline
    or CR can never end the comment and start a line of its own)."""
    return ascii(str(value))[1:-1]


def systemd_text(value: Any) -> str:
    """A value for a unit setting that is free text (Description=): one line, ``%`` doubled
    (systemd expands specifiers such as %n, %h there)."""
    return _one_line(str(value), "unit setting").replace("%", "%%")


def nginx_quote(value: Any) -> str:
    """One nginx directive argument: plain tokens as they are, anything else double-quoted with
    ``\\`` and ``"`` escaped (``;``, ``#``, ``{``, ``}`` and spaces stay inside the argument).
    ``$`` is refused: nginx would expand it as a variable even inside quotes."""
    s = _one_line(str(value), "nginx")
    if _SAFE_NGINX.fullmatch(s):
        return s
    if "$" in s:
        raise RenderError(f"nginx: {s!r}: a `$` would be read as an nginx variable")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_quote(arg: str) -> str:
    """One argument as systemd's ExecStart= parser reads it back unchanged.

    ``%`` (specifiers) and ``$`` (variable expansion) are doubled; anything but plain characters
    is double-quoted with C escapes. :class:`EnvRef` elements become ``${NAME}`` on purpose.
    """
    if isinstance(arg, EnvRef):
        return "${%s}" % str(arg)
    s = str(arg).replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.fullmatch(s):
        return s
    s = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    s = _CONTROL.sub(lambda m: "\\x%02x" % ord(m.group()) if ord(m.group()) < 0x100 else "\\u%04x" % ord(m.group()), s)
    return f'"{s}"'


def systemd_command(argv: Iterable[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


def env_file(values: dict[str, str], comments: Iterable[str] = ()) -> str:
    """A systemd EnvironmentFile: ``KEY=value`` lines, values double-quoted when needed."""
    lines = [f"# {comment_text(c)}" if c else "#" for c in comments]
    for key, value in values.items():
        if not _ENV_NAME.fullmatch(key):
            raise RenderError(f"env: {key!r} is not a valid environment variable name")
        value = str(value)
        if _CONTROL.search(value):
            raise RenderError(f"env.{key}: a value must be one line, without control characters")
        if value == "" or not _SAFE_ENV_VALUE.fullmatch(value):
            # single quotes are verbatim for systemd and for a shell; else double quotes with
            # the escapes both read back the same way
            if "'" not in value:
                value = f"'{value}'"
            else:
                value = '"' + re.sub(r'([\\"`$])', r"\\\1", value) + '"'
        lines.append(f"{key}={value}")
    return "\n".join(lines) + "\n"


def describe_secret(ref: dict[str, Any] | None) -> str:
    """Where a secret lives, for rendered files and messages (never the value)."""
    if not ref:
        return "<no secret configured>"
    if "file" in ref:
        return f"file {ref['file']} on the control machine"
    return f"environment variable {ref['env']} on the control machine"
