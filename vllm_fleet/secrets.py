"""Secret references: `{file: PATH}` or `{env: VAR}` on the control machine.

Values are read only when a deploy writes them to a host (0600 files); they are never rendered,
logged or put in a command line. `generate: true` creates a random key file (mode 0600) the first
time, which is what a lab wants.
"""

from __future__ import annotations

import os
import secrets as _random
import stat
from pathlib import Path
from typing import Any


class SecretError(Exception):
    pass


def describe(ref: dict[str, Any] | None) -> str:
    """Where a secret lives, for rendered files and messages (never the value)."""
    if not ref:
        return "<no secret configured>"
    if "file" in ref:
        return f"file {ref['file']} on the control machine"
    return f"environment variable {ref['env']} on the control machine"


def secret_path(ref: dict[str, Any], base_dir: Path | None = None) -> Path:
    p = Path(os.path.expanduser(ref["file"]))
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return p


def read_secret(ref: dict[str, Any] | None, *, yaml_path: str, base_dir: Path | None = None) -> str | None:
    """Return the secret's value; raise :class:`SecretError` naming the YAML path and the fix."""
    if not ref:
        return None
    if "env" in ref:
        value = os.environ.get(ref["env"])
        if not value:
            raise SecretError(f"{yaml_path}: environment variable {ref['env']} is not set on the control machine; export it before deploying")
        return value.strip()
    p = secret_path(ref, base_dir)
    if not p.exists():
        if not ref.get("generate"):
            raise SecretError(f"{yaml_path}: secret file {p} does not exist; create it (mode 0600) or set `generate: true`")
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("sk-" + _random.token_urlsafe(32) + "\n")
    try:
        mode = p.stat().st_mode
        value = p.read_text().strip()
    except OSError as exc:
        raise SecretError(f"{yaml_path}: cannot read secret file {p}: {exc.strerror}") from None
    if not value:
        raise SecretError(f"{yaml_path}: secret file {p} is empty")
    if "\n" in value or any(c in value for c in "\"'\\$`"):
        raise SecretError(f"{yaml_path}: secret in {p} has a newline, quote, backslash, '$' or backtick; use a plain token")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        import warnings

        warnings.warn(f"{yaml_path}: secret file {p} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it", stacklevel=2)
    return value
