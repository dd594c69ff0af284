"""Each role sees only the spec sections it declares (vllm_fleet.specs.sections)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_fleet.roles import model, monitoring, nginx, nvidia, pyenv, ray, rollout, router, service, smoke, vllm
from vllm_fleet.specs import load as spec_load
from vllm_fleet.specs.sections import SectionNotDeclared, Sections, reads

REPO = Path(__file__).resolve().parent.parent
ROLES = {
    "model": model,
    "monitoring": monitoring,
    "nginx": nginx,
    "nvidia": nvidia,
    "pyenv": pyenv,
    "ray": ray,
    "rollout": rollout,
    "router": router,
    "service": service,
    "smoke": smoke,
    "vllm": vllm,
}


def _resolved() -> dict:
    resolved, problems = spec_load.load_and_check(REPO / "deployments" / "lab-tiny.yaml", hardware=False)
    assert not problems
    return resolved


def test_a_role_reading_a_section_it_does_not_declare_stops_with_its_name():
    @reads("name", "proxy")
    def role(spec):
        return spec["proxy"]["enabled"], spec.get("server")

    with pytest.raises(
        SectionNotDeclared, match=r"role reads the spec's 'server' section .*add 'server' to its @reads"
    ):
        role(_resolved())


def test_a_view_shows_only_its_sections_and_cannot_be_written():
    view = Sections(_resolved(), frozenset({"name", "install"}), "test")
    assert sorted(view) == ["install", "name"] and dict(view)["name"] == "lab-tiny"
    with pytest.raises(SectionNotDeclared):
        "server" in view  # noqa: B015 (a read too)
    with pytest.raises(TypeError):
        view["name"] = "other"  # type: ignore[index]


def test_handing_the_spec_on_needs_every_section_the_next_role_reads():
    narrow = Sections(_resolved(), frozenset({"install"}), "roles.a")
    with pytest.raises(SectionNotDeclared, match=r"roles.a hands the spec to roles.b, which reads 'parallel'"):
        Sections(narrow, frozenset({"install", "parallel"}), "roles.b")


def test_an_unknown_section_name_is_refused_when_the_role_is_defined():
    with pytest.raises(ValueError, match="'proxi' is no top-level section"):
        reads("proxi")


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_roles_readme_names_the_sections_it_declares(role):
    module = ROLES[role]
    declared = set(module.SECTIONS) | set(getattr(module, "STACK_SECTIONS", ()))
    readme = (REPO / "vllm_fleet" / "roles" / role / "README.md").read_text()
    line = next((ln for ln in readme.splitlines() if ln.startswith("Spec sections read:")), None)
    assert line, f"roles/{role}/README.md: no 'Spec sections read:' line"
    assert {w.strip("`,. ") for w in line.split(":", 1)[1].split()} - {"", "and"} == declared
