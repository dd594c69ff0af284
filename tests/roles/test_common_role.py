"""vllm_fleet.roles.common.atomic_put / put_rendered through the commands they would send: a changed file
is uploaded beside its destination and renamed over it (never rewritten in place), a converged
file sends nothing, and unit files are put after the files they name."""

import hashlib

from pyinfra.api import deploy
from pyinfra.facts.files import File, Sha256File

from vllm_fleet.roles.common import put_rendered
from vllm_fleet.render.files import RenderedFile

UNIT = "/etc/systemd/system/vllm.service"
ENV = "/etc/vllm-fleet/x/vllm.env"
FILES = {
    UNIT: RenderedFile("[Service]\nEnvironmentFile=/etc/vllm-fleet/x/vllm.env\n", 0o644),
    ENV: RenderedFile("A=1\n", 0o640, "root", "vllm"),
}


@deploy("put rendered")
def _put(rendered):
    put_rendered(rendered)


def _facts(present: dict):
    def file_fact(path):
        return present.get(path, {}).get("stat")

    def sha(path):
        return present.get(path, {}).get("sha")

    return {File: file_fact, Sha256File: sha}


def test_a_new_file_is_uploaded_beside_it_and_renamed_over_it(harness):
    run = harness.run(_put, FILES, facts=_facts({}))
    unit = run.op(f"Put {UNIT}").commands
    assert unit == [
        f"upload:{UNIT}.tmp-vllm-fleet",
        f"chown root:root {UNIT}.tmp-vllm-fleet",
        f"chmod 644 {UNIT}.tmp-vllm-fleet",
        f"mv -f {UNIT}.tmp-vllm-fleet {UNIT}",
    ]
    env = run.op(f"Put {ENV}").commands
    assert env[-1] == f"mv -f {ENV}.tmp-vllm-fleet {ENV}" and f"chown root:vllm {ENV}.tmp-vllm-fleet" in env
    assert not any(c.startswith(("cp ", "tee ")) or c == f"upload:{UNIT}" for c in run.commands)
    assert run.uploads[UNIT] == FILES[UNIT].content


def test_units_are_put_after_the_files_they_name(harness):
    names = [op.name for op in harness.run(_put, FILES, facts=_facts({})).ops]
    assert [n for n in names if n.startswith("put rendered | Put ")] == [
        f"put rendered | Put {ENV}",
        f"put rendered | Put {UNIT}",
    ], names


def test_a_converged_file_sends_nothing_and_drifted_mode_is_fixed_in_place(harness):
    def present(f, mode, group):
        return {
            "stat": {"user": "root", "group": group, "mode": mode},
            "sha": hashlib.sha256(f.content.encode()).hexdigest(),
        }

    same = {UNIT: present(FILES[UNIT], 644, "root"), ENV: present(FILES[ENV], 640, "vllm")}
    assert not harness.run(_put, FILES, facts=_facts(same)).changed
    drift = {**same, ENV: present(FILES[ENV], 666, "vllm")}
    run = harness.run(_put, FILES, facts=_facts(drift))
    assert run.op(f"Put {ENV}").commands == [f"chmod 640 {ENV}"]
    assert run.op(f"Put {UNIT}").commands == []
