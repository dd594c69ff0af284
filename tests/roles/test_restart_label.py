"""The restart's label says why (issue 24): a unit no deploy has started yet is its "first start",
not "an older configuration"; one started with another configuration is that."""

from __future__ import annotations

import base64

from pyinfra.facts.files import File, Sha256File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from vllm_fleet.host.state import HostState, Snapshot
from test_host_state import _lab, _service_and_nginx, converged_lines


def _names(harness, lines):
    spec, h, node = _lab()
    run = harness.run(
        _service_and_nginx,
        spec,
        h,
        node,
        "k3y",
        facts={
            HostState: lambda query: Snapshot.parse(lines),
            File: {"user": "root"},
            Sha256File: "x",
            SystemdStatus: {},
            SystemdEnabled: {},
        },
    )
    return node.instances[0].unit, [op.name.rsplit(" | ", 1)[-1] for op in run.ops]


def test_first_start_and_older_configuration(harness):
    spec, h, node = _lab()
    lines = converged_lines(spec, h, node, "k3y")
    no_stamp = [ln for ln in lines if not (ln.startswith("read\t") and ln.split("\t")[1].endswith(".applied"))]
    unit, names = _names(harness, no_stamp)
    assert f"Restart {unit} (first start of this configuration)" in names, names
    old = [
        f"read\t{ln.split(chr(9))[1]}\t{base64.b64encode(b'an-older-token').decode()}"
        if ln.startswith("read\t") and ln.split("\t")[1].endswith(".applied")
        else ln
        for ln in lines
    ]
    unit, names = _names(harness, old)
    assert f"Restart {unit} (it runs an older configuration)" in names, names
