"""Property-based fuzzing of the spec front door (issue 12), with hypothesis: mutants of the
example specs (tests/fuzzspecs.py says which) are either refused (exit 1, every error with its
YAML path or line and a fix) or accepted, and then every rendered file passes `nginx -t` /
`systemd-analyze verify`, stays under its root, and holds no line or word that the input added
outside a properly quoted value. Never a traceback.

CI runs a fixed seed (derandomize) and a bounded count (VLLM_FLEET_FUZZ_EXAMPLES, default 400, ~30 s);
bench/fuzz_specs.py runs thousands by hand and prints the counts.
"""

from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings

import fuzzspecs
import test_rendered_validity as trv

EXAMPLES = int(os.environ.get("VLLM_FLEET_FUZZ_EXAMPLES", "400"))
needs_readers = pytest.mark.skipif(
    trv.NGINX is None or not shutil.which("systemd-analyze"),
    reason="nginx and systemd-analyze are needed (apt-get install nginx-light systemd)",
)


@pytest.fixture(scope="module")
def readers():
    r = fuzzspecs.Readers(trv._nginx_prefix, trv._nginx_t, trv.systemd_root, trv._commands)
    yield r
    r.close()


@needs_readers
def test_mutated_specs_are_refused_or_render_valid_files(readers, tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    seen = {"refused": 0, "accepted": 0}

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(fuzzspecs.mutants())
    def prop(m):
        base, changes, doc = m
        out = fuzzspecs.check(fuzzspecs.dump(doc), changes, work, readers)
        assert out.ok, f"{out.kind} for a mutant of {base} {changes}:\n{out.detail}"
        seen[out.kind] += 1
        seen["scrapes"] = seen.get("scrapes", 0) + out.extra.get("scrapes", 0)

    prop()
    # the run exercised both sides (a generator that only made refusals would prove little)
    assert seen["refused"] > 0 and seen["accepted"] > 0, seen


def test_the_marker_check_catches_an_injection():
    """The readers see what a consumer sees: an unquoted `;` in nginx, a `%n` in a unit's
    Description=, a newline in an env value all lose the character before the marker."""
    changes = [("string", "x", "a;INJ0Q"), ("string", "y", "m%nINJ1Q"), ("string", "z", "v\nINJ2Q")]
    marks = fuzzspecs.markers(changes)
    assert marks == {"INJ0Q": {";"}, "INJ1Q": {"%n"}, "INJ2Q": {"\n"}}
    nginx = fuzzspecs.nginx_tokens("server_name a;INJ0Q;\n")
    assert "INJ0Q" in nginx and not any(";INJ0Q" in t for t in nginx)
    assert any(";INJ0Q" in t for t in fuzzspecs.nginx_tokens('server_name "a;INJ0Q";\n'))
    unit = fuzzspecs.unit_tokens("[Unit]\nDescription=vLLM m%nINJ1Q\n")
    assert not any("%nINJ1Q" in t for t in unit)
    assert any("%nINJ1Q" in t for t in fuzzspecs.unit_tokens("[Unit]\nDescription=vLLM m%%nINJ1Q\n"))
    env = fuzzspecs.env_tokens("A=v\nINJ2Q\n")
    assert "INJ2Q" in env and not any("\nINJ2Q" in t for t in env)


# ---------------------------------------------------------------------------------------------
# Fleets (issue 21): inventories and host data, tests/fuzzfleet.py says which

FLEET_EXAMPLES = int(os.environ.get("VLLM_FLEET_FLEET_FUZZ_EXAMPLES", "60"))


@needs_readers
def test_fuzzed_fleets_are_refused_or_render_valid_files(readers, tmp_path_factory):
    """TEST-NET inventories with hostile host data: refused naming a host/spec, or every file
    passes nginx -t, nft -c, systemd-analyze verify and promtool; never a traceback or a hang
    (a few seconds: bench/fuzz_fleet.py runs thousands)."""
    import fuzzfleet

    fleet_readers = fuzzfleet.Readers(readers, tmp_path_factory.mktemp("fuzzfleet"))
    seen = {"refused": 0, "accepted": 0}

    @settings(
        max_examples=FLEET_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(fuzzfleet.fleets())
    def prop(case):
        specs, inventory, marks = case
        out = fuzzfleet.check(specs, inventory, marks, fleet_readers)
        assert out.ok, f"{out.kind} for {[s['name'] for s in specs]} on {inventory}:\n{out.detail}"
        seen[out.kind] += 1
        seen["scrapes"] = seen.get("scrapes", 0) + out.extra.get("scrapes", 0)

    prop()
    print(f"fleet fuzz: {seen}")
    assert seen["refused"] > 0 and seen["accepted"] > 0, seen


WIRED_EXAMPLES = int(os.environ.get("VLLM_FLEET_WIRED_FUZZ_EXAMPLES", "150"))


def test_monitoring_wired_across_hosts_reaches_every_target():
    """Round 3, class 4: Prometheus, the proxy and vLLM on the same or other hosts (ssh and
    private networks apart): refused naming a host or spec, or every rendered target and probe
    passes the firewalls and nginx allow lists the same render wrote (tests/scrapecheck.py)."""
    import fuzzfleet

    seen = {"refused": 0, "accepted": 0, "scrapes": 0}

    @settings(
        max_examples=WIRED_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(fuzzfleet.wired_fleets())
    def prop(case):
        specs, inventory, marks = case
        out = fuzzfleet.check(specs, inventory, marks, None)
        assert out.ok, f"{out.kind} for {[s['name'] for s in specs]} on {inventory}:\n{out.detail}"
        seen[out.kind] += 1
        seen["scrapes"] += out.extra.get("scrapes", 0)

    prop()
    print(f"wired fuzz: {seen}")
    assert seen["refused"] > 0 and seen["accepted"] > 0 and seen["scrapes"] > 0, seen
