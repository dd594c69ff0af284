"""Mutation fuzzing of the example specs (issue 12): shared by tests/test_fuzz_specs.py (CI: a
fixed seed, a bounded count) and bench/fuzz_specs.py (a larger count, by hand).

A mutant is an example spec (deployments/*.yaml) with one to three changes at a path the example
has or the schema knows: a string that carries a special character (newline, CR, NUL, `;`, `#`,
`{`, `}`, `%`, `$`, quotes, a space, `..`) right before a marker word, a number (huge, negative,
integral float, NaN, Infinity, Ray's and privileged ports), a deletion, or a value of another
type. :func:`check` runs `validate` on it (the CLI's own entry point, in this process) and
classifies the result:

* ``refused``: exit 1 and every error names a YAML path (or a line) and a fix;
* ``accepted``: exit 0, and every rendered file passed the independent readers: `nginx -t` on
  each nginx site (with the placeholder and with a real auth include), `systemd-analyze verify`
  on each unit, and the marker check below; every rendered path is absolute and has no `..`;
* anything else is a finding: ``traceback`` (validate raised), ``bad-refusal`` (exit not 0/1, or
  an error without a path or fix), ``render-refused`` (validate accepted what render refuses),
  ``broken-render`` (nginx -t or systemd-analyze failed), ``injected`` (a marker escaped its
  value), ``outside`` (a rendered path leaves its root).

The marker check reads each rendered file the way its consumer does (nginx's tokens, a unit's
settings and Exec words with specifiers and `$` expanded, env-file values, YAML and JSON values,
comments dropped) and requires that every token holding a marker also holds the special
character that came before it in the input: an unescaped value that ends a line, a directive or a
word, or that systemd would expand, loses that character and is caught.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hypothesis import strategies as st

from vllm_fleet.commands import cli

from vllm_fleet.render import files as render

from vllm_fleet.specs import document, load as specmod

REPO = Path(__file__).resolve().parent.parent
BASES = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((REPO / "deployments").glob("*.yaml"))}
ERROR_LINE = re.compile(r"^(?P<file>.+?): error: (?P<path>.+?)(?: \(line (?P<line>\d+)\))?: (?P<msg>.+)$")
SPECIALS = [
    "\n",
    "\r",
    "\x00",
    "\r\n",
    ";",
    "#",
    "{",
    "}",
    "%",
    "%n",
    "$",
    "${HOME}",
    '"',
    "'",
    " ",
    "..",
    "/../",
    "\\",
    "\t",
    "\u2028",
    "`",
]
STARTS = ["x", "/opt/x", "10.0.0.1", "a/b", "", "llm.example", "sk-key", "8000"]
NUMBERS = [
    0,
    -1,
    1,
    8,
    16,
    80,
    443,
    1023,
    1024,
    6379,
    6380,
    8000,
    8000.0,
    8265,
    10001,
    10500,
    52365,
    65535,
    65536,
    2**31,
    2**63,
    10**18,
    0.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
]
OTHERS = [True, False, None, [], {}, "8000", ["a"], {"a": 1}, "true", "null"]


class Raw(str):
    """A scalar written into the YAML as it is (a 4,400-digit number)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Raw, lambda d, v: d.represent_scalar("tag:yaml.org,2002:int", str(v), style=""))


def _schema_paths() -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []

    def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> None:
        if "$ref" in node:
            node = {**document._deref(node["$ref"]), **node}
        props = node.get("properties")
        if not props:
            out.append(prefix)
            return
        for k, sub in props.items():
            walk(sub, prefix + (k,))
        if prefix:
            out.append(prefix)

    walk(specmod.schema(), ())
    return sorted(set(out))


SCHEMA_PATHS = _schema_paths() + [
    ("env", "FUZZ_VAR"),
    ("engine", "speculative", "method"),
    ("engine", "extra_args", 0),
    ("proxy", "metrics_allow", 0),
    ("install", "extra_packages", 0),
]
#: Free-text and path strings where an attack can be accepted (most other strings have a pattern).
TEXT_PATHS = [
    ("description",),
    ("model", "source"),
    ("model", "served_name"),
    ("model", "path"),
    ("model", "revision"),
    ("server", "api_key", "file"),
    ("proxy", "tls", "certificate"),
    ("proxy", "tls", "certificate_key", "file"),
    ("proxy", "server_name"),
    ("install", "prefix"),
    ("install", "wheelhouse"),
    ("install", "index_url"),
    ("smoke", "prompt"),
    ("env", "FUZZ_VAR"),
    ("engine", "extra_args", 0),
    ("install", "extra_packages", 0),
    ("engine", "speculative", "method"),
    ("monitoring", "grafana", "dashboards_dir"),
    ("model", "architecture"),
]


def _leaf_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(doc, dict):
        out = [prefix] if prefix else []
        for k, v in doc.items():
            out += _leaf_paths(v, prefix + (k,))
        return out
    if isinstance(doc, list):
        return [prefix] + [p for i, v in enumerate(doc) for p in _leaf_paths(v, prefix + (i,))]
    return [prefix]


@st.composite
def payloads(draw: Any, marker: str) -> str:
    return (
        draw(st.sampled_from(STARTS))
        + draw(st.sampled_from(SPECIALS))
        + marker
        + draw(st.sampled_from(["", "y", " z", ";", "}", "\n#"]))
    )


@st.composite
def mutants(draw: Any) -> tuple[str, list[tuple], dict[str, Any]]:
    """(base name, the changes, the mutated document)."""
    name = draw(st.sampled_from(sorted(BASES)))
    doc = copy.deepcopy(BASES[name])
    changes: list[tuple] = []
    for i in range(draw(st.integers(1, 3))):
        marker = f"INJ{i}Q"
        kind = draw(
            st.sampled_from(
                ["string", "string", "text", "text", "text", "list-item", "number", "delete", "other", "raw"]
            )
        )
        if kind == "text":  # an attack where free text is accepted
            path, kind = draw(st.sampled_from(TEXT_PATHS)), "string"
        else:
            paths = _leaf_paths(doc) + [tuple(p) for p in SCHEMA_PATHS]
            path = draw(st.sampled_from(sorted(set(paths), key=repr)))
        if kind == "string":
            value: Any = draw(payloads(marker))
        elif kind == "list-item":
            value = [draw(payloads(marker))]
        elif kind == "number":
            value = draw(st.sampled_from(NUMBERS))
        elif kind == "other":
            value = draw(st.sampled_from(OTHERS))
        elif kind == "raw":
            value = draw(
                st.sampled_from([Raw("9" * 4400), Raw("1" + "0" * 40), _nested(40), {"k%d" % j: j for j in range(50)}])
            )
        else:
            value = None
        value = copy.deepcopy(value)  # the lists above must never be changed by a later mutation
        if _apply(doc, path, kind, value):
            changes.append((kind, ".".join(map(str, path)), value if kind != "raw" else type(value).__name__))
    return name, changes, doc


def _nested(depth: int) -> Any:
    v: Any = "x"
    for _ in range(depth):
        v = [v]
    return v


def _apply(doc: Any, path: tuple, kind: str, value: Any) -> bool:
    if not path:
        return False
    node = doc
    for i, part in enumerate(path[:-1]):
        if isinstance(node, dict):
            if not isinstance(node.get(part), (dict, list)):
                node[part] = [] if isinstance(path[i + 1], int) else {}
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return False
    last = path[-1]
    if isinstance(node, list):
        if not isinstance(last, int):
            return False
        if last >= len(node):
            if kind == "delete":
                return False
            node.append(None)
            last = len(node) - 1
        if kind == "delete":
            del node[last]
        else:
            node[last] = value[0] if kind == "list-item" else value
        return True
    if not isinstance(node, dict):
        return False
    if kind == "delete":
        node.pop(last, None)
    else:
        node[last] = value
    return True


def dump(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=False, width=1000)


def markers(changes: list[tuple]) -> dict[str, set[str]]:
    """{marker: the special characters that came right before it in the input}."""
    out: dict[str, set[str]] = {}
    for kind, _path, value in changes:
        for s in value if isinstance(value, list) else [value]:
            if isinstance(s, str):
                for m in re.finditer(r"INJ\dQ", s):
                    before = s[: m.start()]
                    special = next((sp for sp in sorted(SPECIALS, key=len, reverse=True) if before.endswith(sp)), "")
                    out.setdefault(m.group(), set()).add(special)
    return out


# ---------------------------------------------------------------------------------------------
# Readers: the tokens a consumer of each kind of file sees


def nginx_tokens(text: str) -> list[str]:
    toks, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c in ";{}":
            toks.append(c)
            i += 1
        elif c in "\"'":
            buf, i = [], i + 1
            while i < n and text[i] != c:
                if text[i] == "\\" and i + 1 < n:
                    buf.append(text[i + 1])
                    i += 2
                else:
                    buf.append(text[i])
                    i += 1
            toks.append("".join(buf))
            i += 1
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in ";{}":
                j += 1
            toks.append(text[i:j])
            i = j
    return [t.replace("$", "\x00VAR") if "$" in t else t for t in toks]  # nginx expands $name


_C_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "v": "\v",
    "s": " ",
}


def _specifiers(value: str, dollars: bool) -> str:
    out, i = [], 0
    while i < len(value):
        c = value[i]
        if c == "%":
            if value[i + 1 : i + 2] == "%":
                out.append("%")
                i += 2
            else:
                out.append("\x00SPEC")
                i += 2
        elif c == "$" and dollars:
            if value[i + 1 : i + 2] == "$":
                out.append("$")
                i += 2
            else:
                out.append("\x00VAR")
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _exec_words(value: str) -> list[str]:
    words, i, n = [], 0, len(value)
    while i < n:
        if value[i].isspace():
            i += 1
            continue
        buf: list[str] = []
        quote = None
        while i < n and (quote or not value[i].isspace()):
            c = value[i]
            if quote and c == quote:
                quote = None
                i += 1
            elif not quote and c in "\"'":
                quote = c
                i += 1
            elif c == "\\" and i + 1 < n:
                e = value[i + 1]
                if e == "x":
                    buf.append(chr(int(value[i + 2 : i + 4], 16)))
                    i += 4
                elif e == "u":
                    buf.append(chr(int(value[i + 2 : i + 6], 16)))
                    i += 6
                else:
                    buf.append(_C_ESCAPES.get(e, e))
                    i += 2
            else:
                buf.append(c)
                i += 1
        words.append("".join(buf))
    return words


def unit_tokens(text: str) -> list[str]:
    toks = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] in "#;[":
            continue
        key, _, value = s.partition("=")
        toks.append(key)
        exec_like = key.startswith("Exec") or key == "Environment"
        value = _specifiers(value, dollars=exec_like)
        toks += _exec_words(value) if exec_like else [value]
    return toks


def env_tokens(text: str) -> list[str]:
    toks = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        key, _, value = s.partition("=")
        toks.append(key)
        if value[:1] == "'" and value.endswith("'") and len(value) > 1:
            toks.append(value[1:-1])
        elif value[:1] == '"' and value.endswith('"') and len(value) > 1:
            toks.append(re.sub(r"\\(.)", r"\1", value[1:-1]))
        else:
            toks += value.split()
    return toks


def _leaves(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in [str(k), *_leaves(v)]]
    if isinstance(doc, list):
        return [s for v in doc for s in _leaves(v)]
    return [str(doc)]


def _expand_json(tokens: list[str]) -> list[str]:
    out = []
    for t in tokens:
        if t[:1] in "{[":
            try:
                out += _leaves(json.loads(t))
                continue
            except ValueError:
                pass
        out.append(t)
    return out


def tokens_of(path: str, content: str) -> list[str]:
    if path.endswith((".service",)):
        return _expand_json(unit_tokens(content))
    if path.endswith(".conf") and "/nginx/" in path:
        return nginx_tokens(content)
    if path.endswith((".env",)) or path.startswith("/etc/default/"):
        return env_tokens(content)
    if path.endswith((".yml", ".yaml")):
        return _leaves(yaml.safe_load(content))
    if path.endswith(".json"):
        return _leaves(json.loads(content))
    return [w for line in content.splitlines() if not line.lstrip().startswith("#") for w in line.split()]


# ---------------------------------------------------------------------------------------------
# The independent readers of rendered files: nginx -t and systemd-analyze verify


class Readers:
    """nginx -t and systemd-analyze verify, with one systemd root reused across mutants."""

    def __init__(self, nginx_prefix, nginx_t, systemd_root, commands):  # the helpers of test_rendered_validity
        self._prefix, self._nginx_t, self._commands = nginx_prefix, nginx_t, commands
        self.tmp = Path(tempfile.mkdtemp(prefix="vllm-fleet-fuzz-"))
        self.root = systemd_root(self.tmp / "root", [])
        self.n = 0

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def nginx(self, site: str, auths: list[str | None]) -> str | None:
        for auth in auths:
            self.n += 1
            prefix = self._prefix(self.tmp / f"nginx{self.n}", site, auth)
            out = self._nginx_t(prefix)
            shutil.rmtree(prefix, ignore_errors=True)
            if out.returncode != 0:
                return out.stderr.strip()[-600:]
        return None

    def systemd(self, units: dict[str, str], others: dict[str, str]) -> str | None:
        present = {**others, **units}
        written = []
        for exe in {c for t in present.values() for c in self._commands(t)}:
            stub = self.root / exe.lstrip("/")
            if not stub.exists():
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.write_text("#!/bin/sh\nexit 0\n")
                stub.chmod(0o755)
                written.append(stub)
        for p, t in present.items():
            f = self.root / p.lstrip("/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(t)
            written.append(f)
        try:
            out = subprocess.run(
                ["systemd-analyze", f"--root={self.root}", "verify", *units], capture_output=True, text=True, timeout=60
            )
            text = (out.stdout + out.stderr).strip()
            return None if out.returncode == 0 and not text else text[-600:]
        finally:
            for f in written:
                f.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    # refused | accepted | traceback | bad-refusal | render-refused | broken-render | injected | outside | unwired
    kind: str
    detail: str = ""
    files: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.kind in ("refused", "accepted")


def check(text: str, changes: list[tuple], workdir: Path, readers: Readers | None) -> Outcome:
    f = workdir / "mutant.yaml"
    f.write_text(text, encoding="utf-8")
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(["validate", str(f)])
    except BaseException as exc:  # noqa: BLE001 - that is the finding
        import traceback

        return Outcome("traceback", "".join(traceback.format_exception(exc))[-1500:])
    stderr = err.getvalue()
    if "Traceback" in stderr:
        return Outcome("traceback", stderr[-1500:])
    if rc == 1:
        lines = stderr.splitlines()
        errs = [
            (m, lines[i + 1].strip() if i + 1 < len(lines) else "")
            for i, line in enumerate(lines)
            if (m := ERROR_LINE.match(line))
        ]
        if not errs:
            return Outcome("bad-refusal", "exit 1 without an error line:\n" + stderr[-800:])
        for m, fix in errs:
            if not fix.startswith("fix:") or len(fix) < 8:
                return Outcome("bad-refusal", f"no fix: {m.group(0)}")
            if (
                m.group("path") == "(top level)"
                and not m.group("line")
                and "file" not in m.group("msg")
                and "spec" not in m.group("msg")
                and "YAML" not in m.group("msg")
            ):
                return Outcome("bad-refusal", f"no path and no line: {m.group(0)}")
        return Outcome("refused", errs[0][0].group("path"))
    if rc != 0:
        return Outcome("bad-refusal", f"exit {rc}:\n{stderr[-800:]}")
    # accepted: render (role mode) and read every file back
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            resolved, _ = cli._load(str(f))
        targets = render.render(resolved)
    except render.RenderError as exc:
        return Outcome("render-refused", str(exc))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        return Outcome("traceback", "render: " + "".join(traceback.format_exception(exc))[-1500:])
    marks = markers(changes)
    nfiles = 0
    for target, files in targets.items():
        for path, rf in files.items():
            nfiles += 1
            parts = Path(path[2:] if path.startswith("~/") else path).parts
            if not (path.startswith(("/", "~/"))) or ".." in parts or "." in parts:
                return Outcome("outside", f"{target}: {path!r}")
            for tok in tokens_of(path, rf.content):
                for m, specials in marks.items():
                    if m in tok and not any(sp + m in tok for sp in specials):
                        return Outcome("injected", f"{target}:{path}: token {tok[:120]!r} holds {m} without {specials}")
    import scrapecheck

    scrapes, unwired = scrapecheck.unreachable(targets, None)  # role mode: every part on one host
    if unwired:
        return Outcome("unwired", "; ".join(unwired)[:800])
    if readers is not None:
        site_path = render.NGINX_SITE.format(name=resolved["name"])
        auth_path = f"{render.NGINX_SECRET_DIR}/{resolved['name']}-auth.conf"
        for target, files in targets.items():
            if site_path in files:
                auths = (
                    [files[auth_path].content, render.nginx_auth_content(resolved, "sk-fuzz_Key-123")]
                    if auth_path in files
                    else [None]
                )
                bad = readers.nginx(files[site_path].content, auths)
                if bad:
                    return Outcome("broken-render", f"nginx -t {target}: {bad}")
            units = {p: rf.content for p, rf in files.items() if p.endswith(".service")}
            if units:
                others = {
                    p: rf.content
                    for t, fs in targets.items()
                    if t != target
                    for p, rf in fs.items()
                    if p.endswith(".service") and p not in units
                }
                bad = readers.systemd(units, others)
                if bad:
                    return Outcome("broken-render", f"systemd-analyze verify {target}: {bad}")
    return Outcome("accepted", files=nfiles, extra={"scrapes": scrapes})
