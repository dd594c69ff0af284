"""The spec front door: YAML syntax, schema, semantic checks, exit codes, messages."""

from pathlib import Path

import pytest

from fleetutil import DEPLOYMENTS, REPO, run_cli
from vllm_fleet.specs import load as specmod

INVALID = sorted((REPO / "tests" / "specs" / "invalid").glob("*.yaml"))


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.stem)
def test_every_example_spec_validates(path):
    r = run_cli("validate", str(path))
    assert r.returncode == 0, r.stderr
    assert "valid" in r.stdout


def test_examples_cover_the_issue():
    names = {p.stem for p in DEPLOYMENTS}
    assert {
        "lab-tiny",
        "rtx3090-qwen7b-awq-realtime",
        "rtx3090-qwen7b-awq-batch",
        "4xh100-qwen32b-tp4",
        "2node-ray-pp2",
    } <= names


def _expectations(path: Path) -> list[str]:
    """Each invalid case names what stderr must contain in `# expect:` lines."""
    raw = path.read_bytes()
    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("# expect:"):
            out.append(line.split(":", 1)[1].strip())
    return out


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_spec_is_rejected_with_path_and_fix(path):
    r = run_cli("validate", str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "fix:" in r.stderr
    expected = _expectations(path)
    assert expected, f"{path.name} has no '# expect:' line"
    for text in expected:
        assert text in r.stderr, f"{text!r} not in:\n{r.stderr}"


def test_invalid_corpus_is_large_enough():
    assert len(INVALID) >= 20


def test_usage_errors_exit_2():
    assert run_cli("validate").returncode == 2
    assert run_cli("frobnicate").returncode == 2


def test_missing_file_exit_1(tmp_path):
    r = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert r.returncode == 1 and "no such file" in r.stderr


def test_empty_and_binary_and_huge(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: x\nmodel: {source: \xff\xfe}\n")
    huge = tmp_path / "huge.yaml"
    huge.write_text("name: x\n# " + "a" * (2 * 1024 * 1024) + "\n")
    for f, text in ((empty, "empty"), (binary, "UTF-8"), (huge, "at most")):
        r = run_cli("validate", str(f))
        assert r.returncode == 1 and text in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_yaml_syntax_error_has_line(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("name: x\nmodel:\n  source: a/b\n   served_name: [oops\n")
    r = run_cli("validate", str(f))
    assert r.returncode == 1 and "YAML syntax error" in r.stderr and "(line " in r.stderr


def test_unknown_key_suggests_the_near_miss():
    s = specmod.loads("name: x\nmodel:\n  source: a/b\n  servd_name: y\nengine:\n  max_num_seq: 4\n")
    problems = {p.path: p for p in specmod.schema_problems(s)}
    assert "`served_name`" in problems["model.servd_name"].fix
    assert problems["model.servd_name"].line == 4
    assert "`max_num_seqs`" in problems["engine.max_num_seq"].fix


def test_resolve_applies_profiles_and_explicit_values_win():
    s = specmod.loads("name: x\nmodel: {source: a/b}\nengine: {profile: batch, max_num_seqs: 8}\n")
    r = specmod.resolve(s)
    assert r["engine"]["gpu_memory_utilization"] == 0.95  # from the batch profile
    assert r["engine"]["max_num_seqs"] == 8  # explicit
    assert r["model"]["max_model_len"] == 4096
    assert r["model"]["served_name"] == "b"
    assert r["model"]["transfer"] == "hub"


def test_json_output(cli):
    import json

    r = cli("validate", "--json", str(REPO / "deployments" / "lab-tiny.yaml"))
    assert r.returncode == 0
    assert json.loads(r.stdout)["valid"] is True
