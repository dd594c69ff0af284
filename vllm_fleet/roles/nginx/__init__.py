"""nginx in front of vLLM: the package, the rendered streaming-safe site, the auth include (a
secret), TLS when configured; `nginx -t` before every reload; reload, never restart.
"""

from __future__ import annotations

import os
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.files import File
from pyinfra.operations import apt, files, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.roles.common import put_rendered, secret_file

from .defaults import DEFAULTS


@deploy("nginx proxy", data_defaults=DEFAULTS)
def install_nginx(spec: dict[str, Any], rendered: dict[str, Any], api_key: str | None, tls_key: str | None = None):
    """
    Install nginx and the vllm-fleet site for this deployment.

    + spec: the resolved deployment spec
    + rendered: this host's rendered files ({path: RenderedFile}); the /etc/nginx ones are used
    + api_key: the API key (for the auth include, 0600 root; nginx reads it as root at start)
    + tls_key: the TLS private key's value when proxy.tls.certificate_key is set

    **Example:**

    .. code:: python

        install_nginx(spec=ctx["spec"], rendered=rendered_for_host(ctx), api_key=ctx["secrets"]["api_key"])
    """
    from vllm_fleet import render

    prx = spec["proxy"]
    apt.packages(name="nginx package", packages=[host.data.get("nginx_package")], update=True, cache_time=3600)
    changed = []
    if host.data.get("nginx_remove_default_site"):
        changed.append(files.link(name="Remove the default site", path="/etc/nginx/sites-enabled/default", present=False))
    secret_paths = {render.paths(spec)[k] for k in ("nginx_auth", "tls_certificate", "tls_certificate_key")}
    paths = render.paths(spec)
    # This deployment's site only (a host's rendered files hold every deployment's).
    site_paths = [p for p in rendered if p == paths["nginx_site"] and p not in secret_paths]
    # The auth include (and the TLS files below) before the site that names them.
    changed.append(secret_file(name="nginx auth include (0600, never shown)", path=paths["nginx_auth"],
                               content=render.nginx_auth_content(spec, api_key)))
    tls = prx["tls"]
    if tls["enabled"]:
        crt, key = paths["tls_certificate"], paths["tls_certificate_key"]
        if tls["self_signed"]:
            if not host.get_fact(File, path=crt):
                changed.append(server.shell(
                    name="Self-signed TLS certificate",
                    commands=[f"openssl req -x509 -newkey rsa:2048 -nodes -days {int(host.data.get('nginx_self_signed_days'))} "
                              f"-subj /CN={prx['server_name'] if prx['server_name'] != '_' else host.name} "
                              f"-keyout {key} -out {crt} && chmod 600 {key}"],
                ))
        else:
            changed.append(files.put(name="TLS certificate", src=os.path.expanduser(tls["certificate"]), dest=crt, mode="644"))
            changed.append(secret_file(name="TLS private key (0600, never shown)", path=key, content=tls_key or ""))
    put = put_rendered(rendered, site_paths)
    changed += put.values()
    server.shell(name="nginx -t (validate before reload)", commands=["nginx -t"], _if=any_changed(*changed))
    systemd.service(name="nginx running and enabled", service="nginx", running=True, enabled=True)
    systemd.service(name="Reload nginx (config changed)", service="nginx", reloaded=True, _if=any_changed(*changed))
