"""The spec document: load, validate and resolve a deployment spec (the stages; the pipeline
that runs them with the checks is :mod:`vllm_fleet.specs.pipeline`, its short name
:func:`vllm_fleet.specs.load.load_and_check`).

The flow is one way: YAML text -> :func:`load` (syntax, with line numbers) -> JSON Schema
(:func:`schema_problems`, every problem with its YAML path and a fix) -> :func:`resolve`
(profiles and derived defaults filled in) -> semantic checks (:mod:`vllm_fleet.specs.checks`).

Nothing here touches a host or imports pyinfra.
"""

from __future__ import annotations

import copy
import difflib
import ipaddress
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from vllm_fleet.specs import defaults

SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "deployment.schema.json"  # schemas/ at the top links here
MAX_SPEC_BYTES = 256 * 1024  # a spec is a page of YAML (a few kB); this is certainly a mistake


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where (YAML path, line), what, and how to fix it."""

    path: str
    message: str
    fix: str = ""
    severity: str = "error"  # or "warning"
    line: int | None = None

    def format(self) -> str:
        where = self.path or "(top level)"
        if self.line:
            where += f" (line {self.line})"
        text = f"{self.severity}: {where}: {self.message}"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}


class SpecError(Exception):
    """Raised with every problem found; nothing downstream runs on a spec with errors."""

    def __init__(self, problems: list[Problem], source: str = "spec"):
        self.problems = problems
        self.source = source
        errors = [p for p in problems if p.severity == "error"]
        super().__init__(f"{source}: {len(errors)} problem(s)\n" + "\n".join(p.format() for p in problems))


@dataclass
class Spec:
    """A loaded spec: the raw mapping, where each YAML path is, and the file it came from."""

    raw: dict[str, Any]
    lines: dict[str, int] = field(default_factory=dict)
    path: Path | None = None

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    def line(self, dotted: str) -> int | None:
        while dotted:
            if dotted in self.lines:
                return self.lines[dotted]
            dotted = dotted.rpartition(".")[0]
        return None


# ---------------------------------------------------------------------------------------------
# YAML with line numbers


def _join(prefix: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else str(key)


MAX_NODES = 10_000  # a spec has a few hundred values; YAML aliases can expand a 2 kB file to billions
MAX_DEPTH = 32  # a spec nests 4 deep; Python's own recursion limit would end deeper input with a traceback
MAX_NUMBER_CHARS = 32  # longer numbers are not settings (and Python refuses ints beyond 4300 digits)
#: Characters no value may hold: C0/C1 controls, DEL, and the Unicode line and paragraph separators.
#: A newline, CR or NUL in a value ends a line of an nginx config, a unit or an env file.
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: Free text that never reaches a rendered file may span lines (tabs and newlines only).
MULTILINE_TEXT = {"description", "smoke.prompt"}

_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _TooBig(Exception):
    pass


class _Refused(Exception):
    """A YAML construct refused while reading, with where it is."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer stops after MAX_NODES nodes or MAX_DEPTH levels (before the
    whole document is held in memory: a 1 MB flow map is refused after its first values)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _TooBig()
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(
                    Problem(
                        "",
                        f"the YAML nests more than {MAX_DEPTH} levels deep",
                        "write the spec out plainly: its sections nest a few levels",
                        line=mark.line + 1,
                    )
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _scalar(node: yaml.Node, loader: yaml.SafeLoader, path: str) -> Any:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.ScalarNode) and node.tag in (_INT_TAG, _FLOAT_TAG) and len(node.value) > MAX_NUMBER_CHARS:
        raise _Refused(
            Problem(
                path,
                f"a number of {len(node.value)} characters",
                "write the setting's value (see the schema for its range)",
                line=line,
            )
        )
    try:
        value = loader.construct_object(node, deep=True)
    except ValueError as exc:  # e.g. an int Python refuses to convert
        raise _Refused(Problem(path, f"cannot read this value: {exc}", "write a plain value", line=line)) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise _Refused(Problem(path, f"{node.value} is not a finite number", "write a plain number", line=line))
    if isinstance(value, str):
        bad = CONTROL_CHARS.search(value.replace("\n", "").replace("\t", "") if path in MULTILINE_TEXT else value)
        if bad:
            raise _Refused(
                Problem(
                    path,
                    f"the value holds a control character ({bad.group()!r}): it would break the line of the file it "
                    "is written to",
                    "write the value on one line, without control characters",
                    line=line,
                )
            )
    return value


def _construct(
    node: yaml.Node,
    loader: yaml.SafeLoader,
    path: str,
    lines: dict[str, int],
    problems: list[Problem],
    budget: list[int] | None = None,
    stack: tuple[int, ...] = (),
) -> Any:
    budget = budget if budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooBig()
    lines[path] = node.start_mark.line + 1
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        if id(node) in stack:
            raise _Refused(
                Problem(
                    path,
                    "a recursive alias: this value contains itself",
                    "write the value out instead of the alias",
                    line=node.start_mark.line + 1,
                )
            )
        if len(stack) >= MAX_DEPTH:
            raise _Refused(
                Problem(
                    path,
                    f"the values nest more than {MAX_DEPTH} levels deep (anchors and aliases)",
                    "write the spec out plainly",
                    line=node.start_mark.line + 1,
                )
            )
        stack = stack + (id(node),)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            kline = key_node.start_mark.line + 1
            if key_node.tag == _MERGE_TAG:
                problems.append(
                    Problem(
                        path,
                        "YAML merge keys (`<<`) are not supported in a spec",
                        "write the keys out under this section instead of merging an anchor",
                        line=kline,
                    )
                )
                continue
            key = _scalar(key_node, loader, path) if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, (str, int, float, bool)) or key is None:
                problems.append(
                    Problem(path, f"mapping key {key!r} is not a plain name", "use a plain word as the key", line=kline)
                )
                continue
            key = str(key) if not isinstance(key, str) else key
            if key == "" or key.strip() != key:
                problems.append(
                    Problem(
                        path,
                        f"the key {key!r} is empty or has spaces around it",
                        "write the key's name before the ':' (or delete the line)",
                        line=kline,
                    )
                )
                continue
            child = _join(path, key)
            if key in out:
                problems.append(Problem(child, "key appears twice", "keep one of the two", line=kline))
            out[key] = _construct(value_node, loader, child, lines, problems, budget, stack)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(v, loader, _join(path, i), lines, problems, budget, stack) for i, v in enumerate(node.value)]
    return _scalar(node, loader, path)


def _yaml_error_problem(exc: yaml.YAMLError, text: str) -> Problem:
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    line = (mark.line + 1) if mark else None
    position = getattr(exc, "position", None)  # a ReaderError (a control character) has a position, no mark
    if line is None and isinstance(position, int):
        line = text.count("\n", 0, position) + 1
        ch = getattr(exc, "character", None)
        if ch is not None:
            what = f"character {(chr(ch) if isinstance(ch, int) else ch)!r} is not allowed in YAML"
    msg = f"YAML syntax error: {what}" + (f" ({context})" if context else "")
    if line is None:
        return Problem("", msg, "fix the YAML (indentation, a missing ':' or an unclosed quote or bracket)")
    return Problem(
        "", msg, "fix the YAML at that line (indentation, a missing ':' or an unclosed quote or bracket)", line=line
    )


def loads(text: str | bytes, source: str = "spec") -> Spec:
    """Parse YAML text into a :class:`Spec`; raise :class:`SpecError` for unreadable input."""
    if isinstance(text, bytes):
        if len(text) > MAX_SPEC_BYTES:
            raise SpecError(
                [
                    Problem(
                        "",
                        f"file is {len(text)} bytes; a spec is at most {MAX_SPEC_BYTES}",
                        "point at the deployment YAML, not a model or data file",
                    )
                ],
                source,
            )
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError(
                [
                    Problem(
                        "",
                        f"not UTF-8 text (byte {exc.start}: {text[exc.start : exc.start + 1]!r})",
                        "save the file as UTF-8",
                    )
                ],
                source,
            ) from None
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(
            [
                Problem(
                    "",
                    f"file is {len(text)} characters; a spec is at most {MAX_SPEC_BYTES}",
                    "point at the deployment YAML, not a model or data file",
                )
            ],
            source,
        )
    if not text.strip():
        raise SpecError(
            [
                Problem(
                    "", "the spec is empty", "start from an example in deployments/ (e.g. deployments/lab-tiny.yaml)"
                )
            ],
            source,
        )
    problems: list[Problem] = []
    lines: dict[str, int] = {}
    loader = None
    try:
        # Inside the try: the reader itself refuses NUL and other control characters.
        loader = _BoundedLoader(text)
        node = loader.get_single_node()
        if node is None:
            raise SpecError([Problem("", "the spec has no content", "start from an example in deployments/")], source)
        data = _construct(node, loader, "", lines, problems)
    except _Refused as exc:
        raise SpecError([exc.problem], source) from None
    except _TooBig:
        raise SpecError(
            [
                Problem(
                    "",
                    f"the YAML has (or its anchors and aliases expand to) more than {MAX_NODES} values",
                    "write the spec out plainly; a deployment spec needs a few hundred values",
                )
            ],
            source,
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError([_yaml_error_problem(exc, text)], source) from None
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(data, dict):
        raise SpecError(
            [
                Problem(
                    "",
                    f"the spec must be a mapping of sections (model:, engine:, ...), not a {_type_name(data)}",
                    "start from an example in deployments/",
                    line=1,
                )
            ],
            source,
        )
    if problems:
        raise SpecError(problems, source)
    return Spec(raw=data, lines=lines)


def load(path: str | os.PathLike[str]) -> Spec:
    """Read and parse the spec file at ``path``."""
    p = Path(path)
    too_big = Problem(
        "",
        f"the file is larger than {MAX_SPEC_BYTES} bytes; a spec is at most {MAX_SPEC_BYTES}",
        "point at the deployment YAML, not a model or data file",
    )
    try:
        if p.is_dir():
            raise SpecError([Problem("", f"{p} is a directory", "pass the path of a .yaml file")], str(p))
        # O_NONBLOCK: opening a FIFO must not wait for a writer; only a regular file is read,
        # and at most one byte more than the limit (st_size of /dev/zero or a pipe says nothing).
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SpecError(
                    [
                        Problem(
                            "", f"{p} is not a regular file (a device, pipe or socket)", "pass the path of a .yaml file"
                        )
                    ],
                    str(p),
                )
            chunks, size = [], 0
            while size <= MAX_SPEC_BYTES:
                chunk = os.read(fd, MAX_SPEC_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        if size > MAX_SPEC_BYTES:
            raise SpecError([too_big], str(p))
        data = b"".join(chunks)
    except FileNotFoundError:
        raise SpecError(
            [Problem("", f"no such file: {p}", "check the path (examples are in deployments/)")], str(p)
        ) from None
    except PermissionError:
        raise SpecError(
            [Problem("", f"cannot read {p}: permission denied", "check the file's permissions")], str(p)
        ) from None
    except OSError as exc:
        raise SpecError(
            [Problem("", f"cannot read {p}: {exc.strerror or exc}", "pass the path of a readable .yaml file")], str(p)
        ) from None
    spec = loads(data, str(p))
    spec.path = p.resolve()
    return spec


# ---------------------------------------------------------------------------------------------
# JSON Schema with paths, suggestions and fixes


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def _type_name(value: Any) -> str:
    return {
        dict: "mapping",
        list: "list",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _subschema(path: list[Any]) -> dict[str, Any]:
    """The schema node for a data path (following properties / items / $ref)."""
    root = schema()
    node = root
    for part in path:
        if "$ref" in node:
            node = _deref(node["$ref"])
        if isinstance(part, int):
            node = node.get("items", {})
        else:
            node = node.get("properties", {}).get(part) or (
                node.get("additionalProperties") if isinstance(node.get("additionalProperties"), dict) else {}
            )
    if "$ref" in node:
        merged = dict(_deref(node["$ref"]))
        merged.update({k: v for k, v in node.items() if k != "$ref"})
        node = merged
    return node


def routing_policies() -> tuple[str, ...]:
    """``proxy.routing.policy``'s names, as the schema's enum lists them (``auto`` first)."""
    return tuple(_subschema(["proxy", "routing", "policy"])["enum"])


#: The ``proxy.routing.policy`` that puts vLLM's router beside nginx on the proxy hosts (the others
#: are nginx's own).
ROUTER_POLICY = "cache_aware"


def _deref(ref: str) -> dict[str, Any]:
    node: Any = schema()
    for part in ref.lstrip("#/").split("/"):
        node = node[part]
    return node


def _dotted(parts: list[Any]) -> str:
    out = ""
    for p in parts:
        out = _join(out, p)
    return out


def did_you_mean(word: str, choices: list[str]) -> str | None:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not match:
        lowered = {c.lower().replace("-", "_"): c for c in choices}
        match = [
            lowered[k]
            for k in difflib.get_close_matches(word.lower().replace("-", "_"), list(lowered), n=1, cutoff=0.6)
        ]
    return match[0] if match else None


#: The schema's pattern for paths on the hosts (model.path, install.prefix, grafana.dashboards_dir).
HOST_PATH_PATTERN = "^(?!.*/\\.\\.?(/|$))/[A-Za-z0-9._@+/-]*$"
HOST_PATH = re.compile(HOST_PATH_PATTERN[:-1] + "\\Z")

REMOVED_OPTIONS = {
    "engine.swap_space": (
        "`swap_space` (vLLM's --swap-space) was removed from vLLM (gone in 0.32/0.33; the 004 article still uses it)",
        "delete it; to get more KV room, lower max_model_len or max_num_seqs, quantize, or add GPUs",
    ),
}


def _schema_error_to_problems(err: jsonschema.ValidationError, spec: Spec) -> list[Problem]:
    parts = list(err.absolute_path)
    path = _dotted(parts)
    sub = _subschema(parts) if parts else schema()
    v = err.validator
    line = spec.line(path) if path else None
    if v == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        extras = (
            [k for k in err.instance if k not in err.schema.get("properties", {})]
            if isinstance(err.instance, dict)
            else []
        )
        out = []
        for key in extras:
            kpath = _join(path, key)
            hint = did_you_mean(key, allowed)
            fix = f"did you mean `{hint}`?" if hint else f"known keys here: {', '.join(allowed)}"
            out.append(Problem(kpath, "unknown key", fix, line=spec.line(kpath)))
        return out
    if v == "required":
        missing = re.findall(r"'([^']+)' is a required property", err.message)
        key = missing[0] if missing else "?"
        kpath = _join(path, key)
        desc = _subschema(parts + [key]).get("description", "")
        return [
            Problem(
                kpath,
                "required key is missing",
                f"add `{key}:` under `{path or 'the top level'}`" + (f" ({desc.split('. ')[0]})" if desc else ""),
                line=line,
            )
        ]
    if v == "type":
        want = err.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        return [
            Problem(
                path,
                f"expected {want}, got {_type_name(err.instance)} {json.dumps(err.instance, default=str)[:60]}",
                _fix_from_description(sub, f"write {'an' if want[:1] in 'aeiou' else 'a'} {want}"),
                line=line,
            )
        ]
    if v == "enum":
        choices = [c for c in err.validator_value]
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        hint = did_you_mean(str(err.instance), [str(c) for c in choices if c is not None])
        fix = (f"did you mean `{hint}`? " if hint else "") + f"one of: {shown}"
        return [Problem(path, f"{json.dumps(err.instance, default=str)[:60]} is not allowed", fix, line=line)]
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {
            "minimum": "at least",
            "maximum": "at most",
            "exclusiveMinimum": "more than",
            "exclusiveMaximum": "less than",
        }
        return [
            Problem(path, f"{err.instance} is out of range", f"use a value {words[v]} {err.validator_value}", line=line)
        ]
    if v == "pattern" and err.validator_value == HOST_PATH_PATTERN:
        return [
            Problem(
                path,
                f"{json.dumps(err.instance)[:60]} is not a plain absolute path on the hosts",
                "write an absolute path of letters, digits and ._@+-/ with no `.` or `..` part (e.g. /opt/models/x)",
                line=line,
            )
        ]
    if v == "pattern":
        desc = sub.get("description", "").split(". ")[0].rstrip(".")
        fix = f"write {desc[0].lower() + desc[1:]}" if desc else f"it must match {err.validator_value}"
        return [Problem(path, f"{json.dumps(err.instance)[:60]} has the wrong form", fix, line=line)]
    if v == "format":
        if err.validator_value == "ip-network":
            return [
                Problem(
                    path,
                    f"{json.dumps(err.instance)[:60]} is not an IP address or network",
                    "write an address or CIDR such as 10.10.0.11 or 10.10.0.0/24",
                    line=line,
                )
            ]
        return [
            Problem(
                path,
                f"{json.dumps(err.instance)[:60]} is not a valid {err.validator_value} address"
                if "ip" in str(err.validator_value)
                else f"not a valid {err.validator_value}",
                "write a dotted IPv4 address such as 10.10.0.11",
                line=line,
            )
        ]
    if v == "maxLength":
        return [
            Problem(
                path,
                f"longer than {err.validator_value} characters",
                _fix_from_description(sub, "shorten it"),
                line=line,
            )
        ]
    if v == "minLength":
        return [Problem(path, "must not be empty", _fix_from_description(sub, "give a value"), line=line)]
    if v == "oneOf" and "secret" in json.dumps(err.schema.get("description", "")):
        return [
            Problem(
                path,
                "a secret reference needs exactly one of `file` or `env`",
                "write e.g. `{file: ~/.config/vllm-fleet/api-key}` or `{env: VLLM_API_KEY}`",
                line=line,
            )
        ]
    if v == "not":
        removed = REMOVED_OPTIONS.get(path)
        if removed:
            return [Problem(path, removed[0], removed[1], line=line)]
    return [Problem(path, err.message, _fix_from_description(sub, ""), line=line)]


def _fix_from_description(sub: dict[str, Any], fallback: str) -> str:
    desc = sub.get("description", "")
    return (
        desc.split(". ")[0].rstrip(".") + "."
        if desc and not fallback
        else (f"{fallback} ({desc.split('. ')[0].rstrip('.')})" if desc else fallback)
    )


def _whole_pattern(pattern: str) -> re.Pattern[str]:
    """A schema pattern as it is meant (ECMA-262: `$` is the end of the value): Python's `$`
    also matches before a trailing newline, so a final `$` becomes `\\Z`."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + "\\Z"
    return re.compile(pattern)


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _pattern(validator: Any, pattern: str, instance: Any, schema_node: Any):
    if not validator.is_type(instance, "string"):
        return
    compiled = _PATTERNS.get(pattern) or _PATTERNS.setdefault(pattern, _whole_pattern(pattern))
    if not compiled.search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _is_integer(checker: Any, instance: Any) -> bool:
    # JSON Schema counts 8000.0 as an integer; vLLM, nginx and systemd read "8000.0" as text.
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_ip_network(instance: Any) -> bool:
    if not isinstance(instance, str):
        return True
    try:
        ipaddress.ip_network(instance, strict=False)
    except ValueError:
        return False
    return True


@lru_cache(maxsize=1)
def _validator() -> Any:
    base = jsonschema.validators.validator_for(schema())
    cls = jsonschema.validators.extend(
        base, validators={"pattern": _pattern}, type_checker=base.TYPE_CHECKER.redefine("integer", _is_integer)
    )
    formats = copy.deepcopy(base.FORMAT_CHECKER)
    formats.checks("ip-network")(_is_ip_network)
    return cls(schema(), format_checker=formats)


def schema_problems(spec: Spec) -> list[Problem]:
    """Every JSON Schema violation of ``spec``, as problems with paths, lines and fixes."""
    validator = _validator()
    problems: list[Problem] = []
    for err in sorted(validator.iter_errors(spec.raw), key=lambda e: (list(map(str, e.absolute_path)), e.validator)):
        problems.extend(_schema_error_to_problems(err, spec))
    seen = set()
    unique = []
    for p in problems:
        k = (p.path, p.message)
        if k not in seen:
            seen.add(k)
            unique.append(p)
    return unique


# ---------------------------------------------------------------------------------------------
# Resolution: fill in profiles and derived defaults

_PATH_PREFIXES = ("/", "./", "../", "~")


def is_local_path(source: str) -> bool:
    return source.startswith(_PATH_PREFIXES)


def _schema_defaults(node: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, sub in node.get("properties", {}).items():
        if "$ref" in sub:
            sub = {**_deref(sub["$ref"]), **sub}
        if "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
    return out


def _with_defaults(node: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (one section as the user wrote it) with the schema's defaults of ``node`` filled in,
    also in the nested objects whose every key has a default and that have none of their own
    (server.liveness): a new nested section needs no line of code here."""
    out = {**_schema_defaults(node), **raw}
    for key, sub in node.get("properties", {}).items():
        props = sub.get("properties") or {}
        nested = sub.get("type") == "object" and "default" not in sub and props
        if nested and all("default" in p for p in props.values()) and isinstance(out.get(key, {}), dict):
            out[key] = {**_schema_defaults(sub), **(out.get(key) or {})}
    return out


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"[0-9]+", version)[:3])


def vllm_cuda(vllm_version: str) -> tuple[str, str]:
    """``(CUDA of the default wheels, minimum driver branch)`` for a vLLM release (defaults.VLLM_CUDA)."""
    v = _version_tuple(vllm_version)
    for first, cuda, branch in defaults.VLLM_CUDA:
        if v >= _version_tuple(first):
            return cuda, branch
    return defaults.VLLM_CUDA[-1][1:]


def cuda_min_driver(cuda_version: str) -> str:
    """The oldest driver branch a CUDA toolkit version needs (defaults.CUDA_MIN_DRIVER)."""
    table = defaults.CUDA_MIN_DRIVER
    major = cuda_version.split(".")[0]
    return table.get(cuda_version) or table.get(major) or "0"


#: The sections :func:`resolve` fills from the schema's defaults (then from the spec).
RESOLVED_SECTIONS = (
    "model",
    "engine",
    "parallel",
    "server",
    "proxy",
    "replicas",
    "rollout",
    "install",
    "hardware",
    "smoke",
)


def _resolve_model(spec: Spec, out: dict[str, Any]) -> None:
    """model: the transfer (auto: upload for a path, hub for an id), where the weights live, the served name."""
    m, name = out["model"], out["name"]
    if m["transfer"] == "auto":
        m["transfer"] = "upload" if is_local_path(m["source"]) else "hub"
    if m["transfer"] == "upload":
        local = Path(os.path.expanduser(m["source"]))
        if not local.is_absolute():
            local = (spec.base_dir / local).resolve()
        m["local_dir"] = str(local)
    m.setdefault("path", m["source"] if m["transfer"] == "none" else defaults.MODEL_PATH.format(name=name))
    m.setdefault("served_name", m["source"].rstrip("/").split("/")[-1])


def _resolve_engine(spec: Spec, out: dict[str, Any]) -> None:
    """engine: the profile first, explicit keys win (max_model_len is the model's, marked when it came from the
    profile)."""
    m, e = out["model"], out["engine"]
    profile = defaults.PROFILES[e["profile"]]
    for key, value in profile.items():
        if key == "max_model_len":
            continue
        e.setdefault(key, value)
    m.setdefault("max_model_len", profile["max_model_len"])
    m["max_model_len_from_profile"] = "max_model_len" not in (spec.raw.get("model") or {})
    e.pop("swap_space", None)
    kvo = schema()["properties"]["engine"]["properties"]["kv_offload"]
    e["kv_offload"] = {**_schema_defaults(kvo), **(e.get("kv_offload") or {})}


def _resolve_install(out: dict[str, Any], root: dict[str, Any]) -> None:
    """install: versions and paths per accelerator, and the NVIDIA driver that the pinned vLLM needs."""
    ins, hw, name = out["install"], out["hardware"], out["name"]
    acc = ins["accelerator"]
    ins.setdefault("vllm_version", defaults.VLLM_VERSION[acc])
    ins["vllm_package"] = defaults.VLLM_PACKAGE[acc]
    # the one spelling of the prefix every path is built from: written with a trailing slash
    # (the schema allows it) it would give "//" in every path joined to it
    ins["prefix"] = ins.get("prefix", defaults.PREFIX.format(name=name)).rstrip("/") or "/"
    ins.setdefault("ray_version", defaults.RAY_VERSION)
    nv = {**_schema_defaults(root["properties"]["install"]["properties"]["nvidia"]), **(ins.get("nvidia") or {})}
    if acc == "cuda":
        # The driver follows the pinned vLLM (defaults.VLLM_CUDA): its wheels' CUDA, that CUDA's
        # oldest driver branch; an explicit branch below it is refused by vllm_fleet.specs.checks.
        cuda, branch = vllm_cuda(ins["vllm_version"])
        nv.setdefault("cuda_version", cuda)
        nv["vllm_cuda"] = cuda
        nv["min_driver_branch"] = str(max(int(branch), int(cuda_min_driver(nv["cuda_version"]))))
        nv.setdefault("driver_branch", nv["min_driver_branch"])
    ins["nvidia"] = nv
    ins["config_dir"] = defaults.CONFIG_DIR.format(name=name)
    ins["state_dir"] = defaults.STATE_DIR.format(name=name)
    if acc == "cpu":
        hw.setdefault("gpu", "cpu")


def _resolve_proxy(out: dict[str, Any], root: dict[str, Any]) -> None:
    """proxy: TLS and routing (and the router) get their own defaults; `balance` is routing.policy's older name."""
    prx = out["proxy"]
    prx["tls"] = {**_schema_defaults(root["properties"]["proxy"]["properties"]["tls"]), **(prx.get("tls") or {})}
    rt_schema = root["properties"]["proxy"]["properties"]["routing"]
    rt = {**_schema_defaults(rt_schema), **(prx.get("routing") or {})}
    rt["router"] = {**_schema_defaults(rt_schema["properties"]["router"]), **(rt.get("router") or {})}
    if "policy" not in (prx.get("routing") or {}) and prx.get("balance"):
        rt["policy"] = prx["balance"]  # the older key (checks refuse both set differently)
    prx["routing"] = rt
    prx.pop("balance", None)


def _resolve_monitoring(raw: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """monitoring (nested sections get their own defaults)."""
    mon_props = root["properties"]["monitoring"]["properties"]
    mon = {**_schema_defaults(root["properties"]["monitoring"]), **(raw.get("monitoring") or {})}
    for sub in ("alerts", "grafana"):
        mon[sub] = {**_schema_defaults(mon_props[sub]), **(mon.get(sub) or {})}
    return mon


def resolve(spec: Spec) -> dict[str, Any]:
    """The spec with every default filled in: the single input of planner and renderers.

    Call only on a spec without schema problems.
    """
    raw = copy.deepcopy(spec.raw)
    root = schema()
    out: dict[str, Any] = {"name": raw["name"], "description": raw.get("description", "")}
    for section in RESOLVED_SECTIONS:
        sec_schema = root["properties"][section]
        out[section] = _with_defaults(sec_schema, raw.get(section) or {})
    out["env"] = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in (raw.get("env") or {}).items()}
    _resolve_model(spec, out)
    _resolve_engine(spec, out)
    _resolve_install(out, root)
    _resolve_proxy(out, root)
    out["monitoring"] = _resolve_monitoring(raw, root)
    srv, prx, par = out["server"], out["proxy"], out["parallel"]
    srv.setdefault("host", "127.0.0.1" if prx["enabled"] and par["nodes"] == 1 else "0.0.0.0")
    out["rollout"].setdefault("health_timeout", srv["health_timeout"])
    return out
