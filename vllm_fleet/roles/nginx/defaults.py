"""Defaults of the nginx role (documented in README.md beside this file).

The site itself is rendered from the spec's `proxy` section (vllm_fleet.render.files); these are the
role's own knobs.
"""

DEFAULTS = {
    # Debian/Ubuntu package providing nginx.
    "nginx_package": "nginx",
    # Remove the distribution's default site (it claims port 80 as default_server). None: removed
    # on a server, kept on @local (the workstation's own site: vllm-fleet's listens on
    # 127.0.0.1:PORT there, another socket, so nginx -t accepts both; tests/test_inventory_forms.py).
    "nginx_remove_default_site": None,
    # Self-signed certificate lifetime (days) when proxy.tls.self_signed is on.
    "nginx_self_signed_days": 825,
}
