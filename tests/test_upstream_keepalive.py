"""nginx must be the one that closes idle upstream connections (issue 25's 502 while growing).

A POST nginx sends on a keep-alive connection vLLM (uvicorn) is closing at that instant fails
with 502, and nginx does not retry a POST it has sent. With nginx at 4 s and vLLM's default 5 s,
one second of delay in nginx's timers on a loaded proxy host was enough. Read from the rendered
files of every example with a proxy (the nginx site and the replicas' vllm.env): vLLM's keep-alive
is far above nginx's; without a proxy vLLM keeps its default.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_fleet.render import files as render
from vllm_fleet.specs.load import load, resolve

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (REPO / "deployments").glob("*.yaml"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_vllm_keeps_idle_connections_far_longer_than_nginx(name):
    spec = resolve(load(REPO / "deployments" / name))
    text = {path: f.content for part in render.render(spec).values() for path, f in part.items()}
    env = next(t for p, t in text.items() if p.endswith("/vllm.env"))
    vllm = re.search(r"^VLLM_HTTP_TIMEOUT_KEEP_ALIVE=(\d+)$", env, re.M)
    site = next((t for p, t in text.items() if p.startswith("/etc/nginx/conf.d/")), None)
    if not spec["proxy"]["enabled"]:
        assert vllm is None and site is None
        return
    nginx = re.search(r"^\s*keepalive_timeout (\d+)s;", site, re.M)
    assert nginx and vllm, (name, bool(nginx), bool(vllm))
    assert int(vllm.group(1)) >= int(nginx.group(1)) + 30, (name, vllm.group(1), nginx.group(1))
