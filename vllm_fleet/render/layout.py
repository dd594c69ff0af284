"""The per-host layout, as the deploys, roles and commands take it:

    build([resolved, ...], inventory) -> Layout

its parts (what every host runs: :mod:`vllm_fleet.render.parts`) and every file the deploy
places on each host (:mod:`vllm_fleet.render.files`). This module only names them in one
place: the parts do not know the files, and the file builders take the parts' types, so
neither imports the other back.
"""

from __future__ import annotations

from vllm_fleet.render.parts import (  # noqa: F401  (the layout's names)
    AUTO_POLICY,
    BLACKBOX_LISTEN,
    GROUPS,
    HOST_DATA_DEFAULTS,
    HOST_DATA_KEYS,
    LEGACY_UNIT,
    SERVICE_PARTS,
    SYSTEMD_DIR,
    UNIT_SUFFIXES,
    HostLayout,
    Instance,
    Layout,
    LayoutError,
    Node,
    Paths,
    Secret,
    _listen_ports,
    build_parts,
    files_of,
    firewall_addresses,
    gpus_per_instance,
    render_entry,
    replicas_on,
    routing_policy,
    unit_name,
)
from vllm_fleet.render.files import build  # noqa: F401  (the parts, then every file)
