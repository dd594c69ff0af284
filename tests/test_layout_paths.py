"""The paths each part uses are decided once, in the layout (issue 34, item 3): ``Layout.paths``
holds them per deployment when the layout is built; the roles, `down`, serve's pruning and the
rollout are given them (``where``) and call no path function of render themselves."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from vllm_fleet.render import files as render
from vllm_fleet.render.layout import build
from vllm_fleet.specs.load import load_and_check

REPO = Path(__file__).resolve().parents[1]
INVENTORY = {
    "lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy", "monitoring"], "data": {}},
    "lab2": {"address": "10.10.0.12", "groups": ["monitoring"], "data": {}},
}
#: render.paths / render.part_paths / render.monitoring.paths, however imported, and the install
#: stack's env paths (render.command.env_paths, env_python, env_bin: called, imported or aliased, also
#: as ``_env_python``; the roles read ``where["env"]``, ``where["python"]``, ``where["uv"]``)
PATH_CALL = re.compile(
    r"\b(?:render|files|monitoring|_monitoring)\.(?:part_)?paths\(|\bpart_paths\(|(?<![\w.])paths\(spec"
    r"|(?<![A-Za-z0-9])env_(?:paths|python|bin)\b"
)


def test_roles_and_deploys_call_no_path_function_of_render():
    sources = [*(REPO / "vllm_fleet" / "roles").rglob("*.py"), *(REPO / "vllm_fleet" / "deploys").glob("*.py")]
    found = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in sorted(sources)
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if PATH_CALL.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_layout_holds_each_deployments_paths_and_every_fixed_file_is_its_parts():
    spec, _ = load_and_check(REPO / "deployments" / "lab-tiny-monitoring.yaml", hardware=False)
    layout = build([spec], INVENTORY)
    where = layout.paths[spec["name"]]
    assert (
        dict(where) == render.paths(spec) and where["nginx_site"] == f"/etc/nginx/conf.d/vllm-fleet-{spec['name']}.conf"
    )
    # the install stack's env, which pyenv, vllm and model read from here
    env = f"{spec['install']['prefix']}/env"
    assert (where["env"], where["python"], where["uv"]) == (env, f"{env}/bin/python", f"{env}/bin/uv")
    # each file the layout renders for a part is one of that part's declared paths, or a replica's
    # unit or env file (the service's, found by their globs): the removal finds its owner
    replica = ("/etc/systemd/system/vllm-*.service", f"{spec['install']['config_dir']}/replica-*.env")
    for h in layout.hosts.values():
        for path, f in h.files.items():
            if f.deployment != spec["name"]:
                continue
            ok = path in where.parts[f.part] or (
                f.part == "service" and any(PurePosixPath(path).match(g) for g in replica)
            )
            assert ok, (h.name, path, f.part)
    assert where.part_of(where["nginx_site"]) == "nginx" and where.part_of(where["vllm_env"]) == "service"
