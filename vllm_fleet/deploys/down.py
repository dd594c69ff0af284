"""Remove a deployment from its hosts (what `vllm-fleet down` runs; pyinfra runs it per host).

    pyinfra -y INVENTORY vllm_fleet.deploys.down.down --data vllm_fleet_spec=SPEC [--data vllm_fleet_purge=true]

The spec comes from where the serve deploy takes it (vllm_fleet/spec/source.py) and is validated
the same way; each host gets vllm_fleet.roles.teardown with its rendered files (what to remove
comes from them, and what of it is on the host from one state read). Hosts with nothing of the
deployment are left alone.
"""

from vllm_fleet.roles.common import load_deploy_spec, preflight, rendered_for_host


def down() -> None:
    """Remove the current host's part of the deployment."""
    ctx = load_deploy_spec()
    rendered = rendered_for_host(ctx)
    if not rendered:
        return
    preflight()
    from vllm_fleet.roles.teardown import remove_deployment

    remove_deployment(spec=ctx["spec"], rendered=rendered)
