"""Secret references: `{file: PATH}` or `{env: VAR}` on the control machine.

Values are read only when a deploy writes them to a host (0600 files); they are never rendered,
logged or put in a command line. `generate: true` creates a random key file (mode 0600) the first
time, which is what a lab wants; a deploy makes the value in memory while it plans and writes the
file only when it executes (:func:`read_spec_secrets`, :func:`write_generated`), so `--dry` writes
nothing on the control machine.

:data:`SPEC_SECRETS` (a spec fact: :mod:`vllm_fleet.specs.localpath`) is the one list of the secrets a spec can name:
the deploy reads them all from it, `vllm-fleet diff` masks them, and every new secret field goes there.
"""

from __future__ import annotations

import os
import secrets as _random
import stat
from pathlib import Path
from typing import Any

from vllm_fleet.render import files as render
from vllm_fleet.specs import localpath
from vllm_fleet.specs.localpath import SPEC_SECRETS, SpecSecret  # noqa: F401  (the secrets' names too)


class SecretError(Exception):
    pass


def secret_path(ref: dict[str, Any], base_dir: Path | None = None, yaml_path: str = "secret") -> Path:
    """The secret file's path here (``~`` expanded, relative to ``base_dir``); a
    :class:`SecretError` naming ``yaml_path`` when the value can name no file here."""
    try:
        return localpath.expand(ref["file"], base_dir)
    except localpath.LocalPathError as exc:
        raise SecretError(f"{yaml_path}: {ref['file'][:200]!r} cannot be read: {exc.why}; {exc.fix}") from None


def ref_at(resolved: dict[str, Any], yaml_path: str) -> dict[str, Any] | None:
    """The secret reference at a dotted YAML path of the resolved spec (None when unset)."""
    node: Any = resolved
    for part in yaml_path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node or None


def new_token() -> str:
    return "sk-" + _random.token_urlsafe(32)


def read_spec_secrets(
    resolved: dict[str, Any], base_dir: Path | None, generated: dict[Path, str]
) -> dict[str, str | None]:
    """{name: value or None} of every secret in :data:`SPEC_SECRETS`.

    A missing ``generate: true`` file gets a fresh value in memory, recorded in ``generated``
    ({path: value}) and not written: :func:`write_generated` writes it when the deploy executes.
    """
    values = {}
    for s in SPEC_SECRETS:
        ref = ref_at(resolved, s.yaml_path)
        if ref and ref.get("generate") and s.kind != "token":
            raise SecretError(
                f"{s.yaml_path}: `generate: true` makes API-key-like tokens only; give an existing file "
                "(for a lab, proxy.tls.self_signed: true makes a key on the host)"
            )
        values[s.name] = read_secret(ref, yaml_path=s.yaml_path, base_dir=base_dir, generated=generated, kind=s.kind)
    return values


def write_generated(generated: dict[Path, str]) -> list[Path]:
    """Write the generated secret files (0600, in a 0700 directory); return the ones written.

    A file that appeared meanwhile with another value is an error (its value may already be in use)."""
    written = []
    for p, value in generated.items():
        try:
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if p.read_text().strip() != value:
                raise SecretError(
                    f"secret file {p} appeared while this deploy ran (another deploy?); run it again"
                ) from None
            continue
        except OSError as exc:
            raise SecretError(
                f"cannot create the generated secret file {p}: {exc.strerror or exc}; "
                "point the secret's `file:` at a writable place on the control machine"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
        written.append(p)
    return written


def read_secret(
    ref: dict[str, Any] | None,
    *,
    yaml_path: str,
    base_dir: Path | None = None,
    generated: dict[Path, str] | None = None,
    kind: str = "token",
) -> str | None:
    """Return the secret's value; raise :class:`SecretError` naming the YAML path and the fix.

    ``generated`` given: a missing ``generate: true`` file is not written but its new value is
    recorded there (see :func:`read_spec_secrets`); else the file is created now.
    """
    if not ref:
        return None
    if "env" in ref:
        value = os.environ.get(ref["env"])
        if not value:
            raise SecretError(
                f"{yaml_path}: environment variable {ref['env']} is not set on the control machine; export it before "
                "deploying"
            )
        return value.strip() if kind == "token" else value
    p = secret_path(ref, base_dir, yaml_path)
    if generated is not None and p in generated:
        return generated[p]
    why = localpath.why_unreadable(p, "file")
    if why not in (None, "it does not exist"):
        raise SecretError(f"{yaml_path}: cannot read secret file {p}: {why}")
    if why:
        if not ref.get("generate"):
            raise SecretError(
                f"{yaml_path}: secret file {p} does not exist; create it (mode 0600) or set `generate: true`"
            )
        if generated is not None:
            generated[p] = new_token()
            return generated[p]
        write_generated({p: new_token()})
    try:
        mode = p.stat().st_mode
        value = p.read_text()
    except OSError as exc:
        raise SecretError(f"{yaml_path}: cannot read secret file {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SecretError(f"{yaml_path}: secret file {p} is not UTF-8 text") from None
    if kind == "token":
        value = value.strip()
    if not value.strip():
        raise SecretError(f"{yaml_path}: secret file {p} is empty")
    if kind == "pem" and "-----BEGIN" not in value:
        raise SecretError(f"{yaml_path}: {p} is not a PEM file (no -----BEGIN line)")
    if kind == "token" and ("\n" in value or any(c in value for c in "\"'\\$`")):
        raise SecretError(
            f"{yaml_path}: secret in {p} has a newline, quote, backslash, '$' or backtick; use a plain token"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        import warnings

        warnings.warn(
            f"{yaml_path}: secret file {p} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it", stacklevel=2
        )
    return value


def host_secret_files(resolved: dict[str, Any], values: dict[str, Any]) -> dict[str, str]:
    """{host path: content} of every file that holds a secret of the spec, as the deploy writes
    it (0600 root): the API key's env file and nginx auth include, the TLS private key. The roles
    write these, `vllm-fleet diff` compares their checksums (never their text)."""
    p = render.paths(resolved)
    key = values.get("api_key")
    out = {
        p["secrets_env"]: render.secrets_env_content(resolved, key) if key else "# no API key configured\n",
        p["nginx_auth"]: render.nginx_auth_content(resolved, key),
    }
    tls = resolved["proxy"].get("tls") or {}
    if tls.get("enabled") and not tls.get("self_signed") and values.get("tls_key"):
        out[p["tls_certificate_key"]] = values["tls_key"]
    return out
