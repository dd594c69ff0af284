"""Paths on the control machine that a spec names, read without a traceback.

Every spec value that names a file or directory on the control machine is in
:data:`CONTROL_PATHS` (the one list): ``model.source`` (``transfer: upload``),
``install.wheelhouse``, ``proxy.tls.certificate`` and the ``file`` of every secret reference
(:data:`SPEC_SECRETS`). :func:`control_path_problems` looks at each
once per check: a value that can be no path on any Linux machine (a NUL, a name over NAME_MAX,
a path over PATH_MAX) is an error; one that cannot be read on this machine (``~user`` with no
such user, missing, the wrong kind, permission denied) is a warning, because the deploy reads it
here and stops there. :func:`expand` and :func:`why_unreadable` are what every reader of these
paths uses (the FlashInfer probe, the secrets, the roles' uploads), so none of them meets a
RuntimeError or an OSError it did not expect.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

#: Linux's limits (limits.h): bytes in one name, and in a path with its terminating NUL.
NAME_MAX = 255
PATH_MAX = 4096


class LocalPathError(ValueError):
    """A value that names no path here: ``why`` (one clause) and ``fix``."""

    def __init__(self, why: str, fix: str, anywhere: bool) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix
        self.anywhere = anywhere  # True: no machine has such a path (an error, not a warning)


def _short(value: str) -> str:
    return value if len(value) <= 80 else f"{value[:40]}...{value[-30:]} ({len(value)} characters)"


def expand(value: str, base_dir: Path | None = None) -> Path:
    """``value`` as a path on this machine: ``~`` and ``~user`` expanded, a relative path taken
    from ``base_dir`` (the working directory when None). :class:`LocalPathError` when it can be
    no path (a NUL, a name over NAME_MAX, a path over PATH_MAX, not encodable) or names a user
    this machine does not have."""
    if "\0" in value:
        raise LocalPathError(
            "it holds a NUL character, which no file name can", "remove the NUL (\\0) from the path", True
        )
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        user = value[1:].split("/", 1)[0]
        why = (
            f"there is no user {user!r} on this machine to expand ~{user}"
            if user
            else "HOME is not set, so ~ cannot be expanded"
        )
        raise LocalPathError(
            why,
            "write the path out in full (e.g. /home/NAME/...), or run on the control machine that has that user",
            False,
        )
    p = Path(expanded)
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    try:
        raw = os.fsencode(str(p))
    except (UnicodeEncodeError, ValueError):
        raise LocalPathError(
            "it is not encodable as a file name here", "use a path of plain characters", True
        ) from None
    long = next((part for part in raw.split(b"/") if len(part) > NAME_MAX), None)
    if long is not None:
        raise LocalPathError(
            f"one of its names is {len(long)} bytes, over NAME_MAX ({NAME_MAX}): no file system holds such a name",
            "shorten that directory or file name",
            True,
        )
    if len(raw) >= PATH_MAX:
        raise LocalPathError(
            f"it is {len(raw)} bytes, over PATH_MAX ({PATH_MAX} with its final NUL): no program can open it",
            "use a shorter path (move the files, or a symbolic link with a short name)",
            True,
        )
    return p


def why_unreadable(p: Path, kind: str) -> str | None:
    """Why the ``kind`` (``dir`` or ``file``) at ``p`` cannot be read here; None when it can."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return "it does not exist"
    except NotADirectoryError:
        return "a part of it is not a directory"
    except PermissionError:
        return "permission denied on a directory above it"
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if kind == "file" and stat.S_ISDIR(st.st_mode):
        return "it is a directory, not a file"
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        return "it is not a regular file (a device, pipe or socket)"
    if not os.access(p, os.R_OK | (os.X_OK if kind == "dir" else 0)):
        return "permission denied"
    return None


def readable(value: str, kind: str, base_dir: Path | None = None) -> tuple[Path | None, str | None, str | None]:
    """``(path, why, fix)``: the path when ``value`` names a readable ``kind`` here, else None,
    why and the fix (never raises)."""
    try:
        p = expand(value, base_dir)
    except LocalPathError as exc:
        return None, exc.why, exc.fix
    why = why_unreadable(p, kind)
    if why:
        return None, why, None
    return p, None, None


@dataclass(frozen=True)
class ControlPath:
    """A spec value naming a path on the control machine: its YAML path, ``dir`` or ``file``,
    what the deploy does with it, and when it is read (``value``: the string, or None when unused)."""

    yaml_path: str
    kind: str
    use: str
    value: Callable[[dict[str, Any]], Any]
    relative_to_spec: bool = True  # else relative to the working directory (as the deploy reads it)
    may_be_missing: Callable[[dict[str, Any]], bool] = lambda r: False


@dataclass(frozen=True)
class SpecSecret:
    """A secret field of the spec: its YAML path, the name the deploy knows its value by, and its
    kind: ``token`` (one line, no quotes: API keys, hub tokens) or ``pem`` (a PEM block)."""

    yaml_path: str
    name: str
    kind: str = "token"


#: Every secret a spec can name (the one list): the deploy reads each one, on the control machine.
SPEC_SECRETS = (
    SpecSecret("server.api_key", "api_key"),
    SpecSecret("model.hub_token", "hub_token"),
    SpecSecret("proxy.tls.certificate_key", "tls_key", "pem"),
)


def _get(r: dict[str, Any], dotted: str) -> Any:
    node: Any = r
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _tls_on(r: dict[str, Any]) -> dict[str, Any]:
    tls = r["proxy"].get("tls") or {}
    return tls if tls.get("enabled") and not tls.get("self_signed") else {}


def _secret_paths() -> tuple[ControlPath, ...]:
    out = []
    for s in SPEC_SECRETS:

        def value(r: dict[str, Any], at: str = s.yaml_path) -> Any:
            ref = _get(r, at)
            if at.startswith("proxy.tls.") and not _tls_on(r):
                return None
            return ref.get("file") if isinstance(ref, dict) else None

        def generated(r: dict[str, Any], at: str = s.yaml_path) -> bool:
            return bool((_get(r, at) or {}).get("generate"))

        out.append(
            ControlPath(
                f"{s.yaml_path}.file", "file", "the deploy reads the secret there", value, may_be_missing=generated
            )
        )
    return tuple(out)


#: Every spec value naming a path on the control machine (secrets' files added from SPEC_SECRETS).
CONTROL_PATHS: tuple[ControlPath, ...] = (
    ControlPath(
        "model.source",
        "dir",
        "the deploy uploads the weights from there",
        lambda r: r["model"]["source"] if r["model"]["transfer"] == "upload" else None,
    ),
    ControlPath(
        "install.wheelhouse",
        "dir",
        "the deploy uploads the wheels from there (and validate reads it for the FlashInfer check)",
        lambda r: r["install"].get("wheelhouse"),
        relative_to_spec=False,
    ),
    ControlPath(
        "proxy.tls.certificate",
        "file",
        "the deploy reads the certificate there",
        lambda r: _tls_on(r).get("certificate"),
    ),
)


def control_paths() -> tuple[ControlPath, ...]:
    return CONTROL_PATHS + _secret_paths()


def control_path_problems(r: dict[str, Any], base_dir: Path | None, add: Callable[..., None]) -> None:
    """One problem for each control-machine path of the spec that names no readable file or
    directory here (``add(path, message, fix, severity)``)."""
    for cp in control_paths():
        value = cp.value(r)
        if not isinstance(value, str) or not value:
            continue
        shown = _short(value)
        try:
            p = expand(value, base_dir if cp.relative_to_spec else None)
        except LocalPathError as exc:
            add(
                cp.yaml_path,
                f"{shown} cannot be read on {'any' if exc.anywhere else 'this'} machine: {exc.why}; {cp.use}",
                exc.fix,
                "error" if exc.anywhere else "warning",
            )
            continue
        why = why_unreadable(p, cp.kind)
        if why is None or (why == "it does not exist" and cp.may_be_missing(r)):
            continue
        what = "directory" if cp.kind == "dir" else "file"
        add(
            cp.yaml_path,
            f"{_short(str(p))} cannot be read on this machine: {why}; {cp.use}",
            f"point it at a readable {what} on the control machine (a relative path is taken from "
            f"{'the spec file' + chr(39) + 's directory' if cp.relative_to_spec else 'the working directory'}), or "
            "run this where it is",
            "warning",
        )
