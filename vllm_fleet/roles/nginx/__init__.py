"""nginx in front of vLLM: the package, the rendered streaming-safe site, the auth include (a
secret), TLS when configured; `nginx -t` before every reload; reload, never restart.
"""

from __future__ import annotations

from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.host import programs
from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import chain, group
from vllm_fleet.roles.common import (
    DeployError,
    atomic_put,
    packages,
    put_rendered,
    put_secret,
    remove,
    rendered_query,
    service_running,
)
from vllm_fleet.host.state import Query
from vllm_fleet.render.parts import Paths, files_of
from vllm_fleet.roles.common.state import host_state, pending, role_state
from vllm_fleet.specs.sections import reads

from vllm_fleet.specs.hostdata import is_local

from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("install", "monitoring", "name", "proxy", "server")

DEFAULT_SITE = "/etc/nginx/sites-enabled/default"


def remove_default_site(name: str, setting: bool | None) -> bool:
    """Whether the distribution's default site goes: host data ``nginx_remove_default_site``, else
    yes on a server and no on ``@local``, the desktop whose own nginx site stays (vllm-fleet's
    site there listens on 127.0.0.1, render.files.nginx_listen)."""
    return (not is_local(name)) if setting is None else bool(setting)


@deploy("nginx proxy", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_nginx(
    spec: dict[str, Any],
    where: Paths,
    rendered: dict[str, Any],
    api_key: str | None = None,
    tls_key: str | None = None,
    tls_certificate: str | None = None,
    present: bool = True,
    paths: list[str] | None = None,
):
    """
    Install nginx and the vllm-fleet site for this deployment, or (``present=False``) remove it.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: ``ctx.layout.paths[name]``, vllm_fleet.render.parts.Paths)
    + rendered: this host's rendered files ({path: RenderedFile}); the /etc/nginx ones are used
    + api_key: the API key (for the auth include, 0600 root; nginx reads it as root at start)
    + tls_key: the TLS private key's value when proxy.tls.certificate_key is set (0600 root, never shown)
    + tls_certificate: the certificate's text when proxy.tls.certificate is set (both are read on the
      control machine by ``load_deploy_spec``: ``ctx.secrets["tls_key"]``, ``["tls_certificate"]``)
    + present: False removes this deployment's site, auth include and TLS files (those the host's
      copy shows as the deployment's: vllm_fleet.roles.common.remove.mine), then ``nginx -t`` and a
      reload when nginx runs; the package and other sites stay. The secrets are not needed then.
    + paths: with ``present=False``, remove only these (serve's pruning: what the layout no longer
      gives the host); default: every nginx file the deployment may have here

    **Example:**

    .. code:: python

        where = ctx.layout.paths[ctx.first]
        install_nginx(spec=ctx.spec, where=where, rendered=rendered_for_host(ctx), api_key=ctx.secrets["api_key"],
                      tls_key=ctx.secrets["tls_key"], tls_certificate=ctx.secrets["tls_certificate"])
        install_nginx(spec=ctx.spec, where=where, rendered=rendered_for_host(ctx), present=False)  # the site gone
    """
    if not present:
        return _absent(spec, where, rendered, paths)
    from vllm_fleet.render.secrets import host_secret_files

    # no apt lists refresh (network) when nginx is installed: roles.common.packages
    package = packages(name="nginx package", packages=[host.data.get("nginx_package")], update=True, cache_time=3600)
    snap = host_state()
    changed = []
    # The package installs the default site: the snapshot's "absent" holds only when nginx was installed already.
    if remove_default_site(host.name, host.data.get("nginx_remove_default_site")) and (
        pending(package) or not snap.absent(DEFAULT_SITE)
    ):
        changed.append(files.link(name="Remove the default site", path=DEFAULT_SITE, present=False))
    # This deployment's nginx files (files_of its part), but the auth include: put with the key below.
    site_paths = [p for p in files_of(rendered, spec["name"], "nginx") if p != where["nginx_auth"]]
    # The auth include (and the TLS files below) before the site that names them.
    secret_text = host_secret_files(spec, {"api_key": api_key, "tls_key": tls_key})
    # A site that breaks `nginx -t` (e.g. a second default server on its port) must not stay:
    # keep this deployment's current files first, put them back when the check fails.
    keep = _keep_for_rollback(spec, rendered, site_paths, where["nginx_auth"], secret_text[where["nginx_auth"]], snap)
    changed.append(
        put_secret(
            name="nginx auth include (0600, never shown)",
            path=where["nginx_auth"],
            content=secret_text[where["nginx_auth"]],
        )
    )
    changed += _tls_files(spec, where, secret_text, tls_key=tls_key, tls_certificate=tls_certificate)
    put = put_rendered(rendered, site_paths)
    changed += put.values()
    # (operations only where something differs: a converged proxy gets none, vllm_fleet.roles.common.state)
    if pending(*changed):
        server.shell(
            name="nginx -t (validate before reload; a failure puts the previous site back)"
            if keep
            else "nginx -t (validate before reload)",
            commands=[_validate_or_restore(spec["name"], keep)],
            _if=any_changed(*changed),
        )
    service_running(name="nginx running and enabled", service="nginx", running=True, enabled=True)
    if pending(*changed):
        systemd.service(name="Reload nginx (config changed)", service="nginx", reloaded=True, _if=any_changed(*changed))


def _absent(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """present=False: the deployment's nginx files removed; the site's removal validated with
    ``nginx -t`` and reloaded (never restarted) when nginx runs (its unit as the state read saw
    it). {path: its remove operation}."""
    paths = remove.placed(spec, where, rendered, "nginx") if paths is None else paths
    owned, snap = remove.owned(spec, where, paths, "nginx files", units=("nginx.service",))
    removed = remove.remove_files(owned, "nginx")
    site = removed.get(where["nginx_site"])
    if site is not None:
        server.shell(name="nginx -t (validate before reload)", commands=[cmd("nginx", "-t")], _if=site.did_change)
        if (snap.unit("nginx.service") or {}).get("ActiveState") == "active":
            systemd.service(name="Reload nginx (site removed)", service="nginx", reloaded=True, _if=site.did_change)
    return removed


def _tls_files(
    spec: dict[str, Any], where: Paths, secret_text: dict[str, str], *, tls_key: str | None, tls_certificate: str | None
) -> list:
    """``proxy.tls.enabled``: a self-signed certificate made on the host once (none there yet), or
    the given certificate and key put (the key 0600, never shown). Returns the operations that
    change nginx's input."""
    from vllm_fleet.render import files as render

    prx = spec["proxy"]
    tls = prx["tls"]
    if not tls["enabled"]:
        return []
    crt, key = where["tls_certificate"], where["tls_certificate_key"]
    if tls["self_signed"]:
        # state_query stats it (the deploy's one read; a role called on its own reads it once)
        _, there = role_state(Query(stat=(crt,))).path(crt)
        if there:
            return []
        # guarded: a read that did not complete never replaces a certificate clients may pin
        return [
            server.shell(
                name="Self-signed TLS certificate",
                commands=[
                    chain(
                        cmd("test", "-f", crt),
                        group(
                            chain(
                                cmd(
                                    "openssl",
                                    "req",
                                    "-x509",
                                    "-newkey",
                                    "rsa:2048",
                                    "-nodes",
                                    "-days",
                                    int(host.data.get("nginx_self_signed_days")),
                                    "-subj",
                                    f"/CN={prx['server_name'] if prx['server_name'] != '_' else host.name}",
                                    "-keyout",
                                    key,
                                    "-out",
                                    crt,
                                ),
                                cmd("chmod", "600", key),
                            )
                        ),
                        op="||",
                    )
                ],
            )
        ]
    if not tls_certificate or not tls_key:
        raise DeployError(
            f"{host.name}: proxy.tls: the certificate and its key were not read on the control machine "
            "(pass tls_certificate= and tls_key= from load_deploy_spec's ctx); no host was changed"
        )
    files.directory(
        name=f"Directory {render.NGINX_SECRET_DIR} (0700)",
        path=render.NGINX_SECRET_DIR,
        user="root",
        group="root",
        mode="700",
    )
    return [
        atomic_put(name="TLS certificate", dest=crt, content=tls_certificate, mode="644"),
        put_secret(name="TLS private key (0600, never shown)", path=key, content=secret_text[key]),
    ]


ROLLBACK_DIR = "/var/lib/vllm-fleet/nginx-previous"


def _keep_for_rollback(
    spec: dict[str, Any], rendered: dict[str, Any], site_paths: list[str], auth: str, auth_text: str, snap: Any
) -> list[str]:
    """When the snapshot shows this deployment's site or auth include about to change: an operation
    (before their puts) that copies the current ones aside; the paths kept. Without a snapshot
    (the role on its own) nothing is kept: a plain `nginx -t`, as before."""
    from vllm_fleet.roles.common import _sha256

    if not snap.known:
        return []
    stale = [
        p
        for p in site_paths
        if not snap.file_ok(
            p, _sha256(rendered[p].content), rendered[p].owner, rendered[p].group, f"{rendered[p].mode:o}"
        )
    ]
    if not stale and snap.file_ok(auth, _sha256(auth_text), "root", "root", "600"):
        return []
    keep = [*site_paths, auth]
    server.shell(
        name=f"Keep the current nginx files of {spec['name']} (put back if nginx -t fails)",
        commands=_keep_commands(spec["name"], keep),
    )
    return keep


def _keep_commands(name: str, keep: list[str]) -> list:
    """Keep the deployment's current nginx files (vllm_fleet/host/scripts/nginx_keep.sh)."""
    return [programs.shell("nginx_keep.sh", f"{ROLLBACK_DIR}/{name}", *keep)]


def _validate_or_restore(name: str, keep: list[str]):
    """`nginx -t`; with files kept: on failure put them back (a file that was not there is
    removed), say so, and fail the host before any reload: nginx stays as it was
    (vllm_fleet/host/scripts/nginx_test_or_restore.sh)."""
    if not keep:
        return programs.argv("nginx", "-t")
    return programs.shell("nginx_test_or_restore.sh", name, f"{ROLLBACK_DIR}/{name}", *keep)


@reads(*SECTIONS)
def state_query(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> Query:
    """What install_nginx compares against (vllm_fleet.roles.common.state): the package, the
    default site, this deployment's site, auth include and TLS files, nginx's unit."""
    auth = where["nginx_auth"]
    files_ = [p for p in files_of(rendered, spec["name"], "nginx") if p != auth] + [auth]
    if spec["proxy"]["tls"]["enabled"]:
        files_ += [where["tls_certificate"], where["tls_certificate_key"]]
    pkg = host.data.get("nginx_package") or DEFAULTS["nginx_package"]
    return rendered_query(rendered, files_) | Query(stat=(DEFAULT_SITE,), debs=(pkg,), units=("nginx.service",))
