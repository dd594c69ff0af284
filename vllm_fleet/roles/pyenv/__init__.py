"""The pyenv role: the deployment's Python environment at ``{install.prefix}/env``, and the
service user with its directories.

Deploy functions (``spec`` is the resolved spec dict from ``vllm_fleet.specs.load.load_and_check``;
``where`` where the deployment's files live, the layout's vllm_fleet.render.parts.Paths: the env is
``where["env"]``, its python ``where["python"]``)
    ``service_dirs(spec)``: the system user ``server.user`` (no login shell, home =
    the parent of ``install.state_dir`` (/var/lib/vllm-fleet), no home created by useradd) and the directories
    ``install.prefix`` (root:root 0755), ``install.config_dir`` (root:<user> 0750; the service
    role writes secrets.env there 0600 root:root) and ``install.state_dir`` (<user>:<user> 0750).
    The service role calls it too; both calls converge to the same state.

    ``pyenv(spec, where)``: ``install.env_manager``
      - ``venv``: apt ``python3-venv`` (with ``install.accelerator: cuda`` also ``python3-dev`` and
        ``gcc``: Triton compiles its launcher against Python.h when vLLM starts), then
        ``python3 -m venv {prefix}/env`` unless that env's python already runs (the system
        python3's version; install.python is not used).
      - ``conda``: (cuda: apt ``gcc`` first, the env has its own headers) Miniforge ``pyenv_miniforge_version`` at
        ``pyenv_miniforge_root`` (default /opt/miniforge3), installed only when absent or recorded at another
        version: download to a ``.part`` file, ``sha256sum --check`` against the pinned sha256, and only then run the
        installer (``bash … -b -p ROOT``, ``-u`` to update an existing root). Then
        ``conda create -y -p {prefix}/env --override-channels -c conda-forge python=X.Y`` unless
        the env exists with that Python. An env with another Python stops the deploy
        (``EnvMismatch``) rather than being replaced.
    What is on the host comes from the one state read (``state_query``; ``role_state``: the
    deploy's, or one read when the role runs on its own): the user, the directories, the venv
    packages, the env's python version (the env probe), a stat of ``{root}/bin/conda`` and the
    recorded Miniforge version; a second deploy issues no command. A conda env or Miniforge whose
    read did not complete stops the host with ``StateUnknown`` (``conda create`` over an existing
    env would replace it); a venv is made with a guard (``test -x PY || python3 -m venv ENV``).

Example (deploys/serve.py)::

    from vllm_fleet.roles.pyenv import pyenv, service_dirs

    where = ctx.layout.paths[spec["name"]]  # decided once, when the layout is built
    service_dirs(spec)
    pyenv(spec, where)
    # the env's python for the next roles:
    python = where["python"]   # /opt/vllm-fleet/NAME/env/bin/python
"""

from __future__ import annotations

from pathlib import PurePosixPath

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import apt, server

from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import chain, to_file
from vllm_fleet.render.parts import Paths
from vllm_fleet.roles.common import directory, packages as common_packages, role_data
from vllm_fleet.host.state import Query, Snapshot
from vllm_fleet.roles.common.state import host_state, role_state, unknown
from vllm_fleet.specs.sections import reads

from . import defaults as d
from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("install", "server")

__all__ = ["pyenv", "service_dirs", "state_query", "EnvMismatch", "DEFAULTS"]


class EnvMismatch(DeployError):
    """The env exists with another Python than install.python."""


@deploy("Service user and directories", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def service_dirs(spec: dict) -> None:
    ins, user = spec["install"], spec["server"]["user"]
    home = str(PurePosixPath(ins["state_dir"]).parent)
    if host_state().user_ok(user, home=home, shell=d.SERVICE_SHELL):
        host.noop(f"system user {user} exists")
    else:
        _user(user, home)
    directory(name="Install prefix", path=ins["prefix"], user="root", group="root", mode=d.PREFIX_MODE)
    directory(name="Config directory", path=ins["config_dir"], user="root", group=user, mode=d.CONFIG_DIR_MODE)
    directory(name="State directory", path=ins["state_dir"], user=user, group=user, mode=d.STATE_DIR_MODE)


def _data(key: str):
    return role_data(key, DEFAULTS)


def _miniforge_root() -> str:
    return _data("pyenv_miniforge_root").rstrip("/")


@reads(*SECTIONS)
def state_query(spec: dict, where: Paths) -> Query:
    """What service_dirs and pyenv compare against (vllm_fleet.roles.common.state): the user,
    the directories, the env's python (probed with the vllm role's); for a venv its packages,
    for conda the Miniforge (``bin/conda`` stat'ed, the recorded version read) and the C compiler."""
    ins = spec["install"]
    q = Query(
        stat=(ins["prefix"], ins["config_dir"], ins["state_dir"]),
        users=(spec["server"]["user"],),
        envs=((where["python"], ()),),
    )
    cuda = ins["accelerator"] == "cuda"
    if ins["env_manager"] == "venv":
        packages = list(_data("pyenv_venv_packages")) + (list(_data("pyenv_cuda_venv_packages")) if cuda else [])
        return q | Query(debs=tuple(packages))
    root = _miniforge_root()
    return q | Query(
        stat=(f"{root}/bin/conda",),
        read=(f"{root}/{d.MINIFORGE_MARKER}",),
        debs=tuple(_data("pyenv_cuda_conda_packages")) if cuda else (),
    )


def _user(user: str, home: str) -> None:
    server.user(
        name=f"System user {user}",
        user=user,
        system=True,
        # One system user may serve several deployments on a host (e.g. a single-node and a
        # multi-node spec in turn): its home is their common parent, never one deployment's
        # state dir (usermod cannot move the home of a user with running processes).
        home=home,
        shell=d.SERVICE_SHELL,
        ensure_home=False,
        create_home=False,
    )


def _venv(env: str, py: str, cuda: bool, snap: Snapshot) -> None:
    packages = list(host.data.get("pyenv_venv_packages"))
    if cuda:
        packages += [p for p in host.data.get("pyenv_cuda_venv_packages") if p not in packages]
    common_packages(
        name="python3-venv" + (" and the headers + C compiler Triton builds with" if cuda else ""),
        packages=packages,
        update=False,
    )
    probed = snap.env(py)
    if probed is None or probed["python"] is None:
        # guarded: a read that did not complete never re-makes an env that is there
        server.shell(
            name=f"venv at {env}", commands=[chain(cmd("test", "-x", py), cmd("python3", "-m", "venv", env), op="||")]
        )


def _miniforge(snap: Snapshot) -> str:
    root = _miniforge_root()
    version = host.data.get("pyenv_miniforge_version")
    known, conda = snap.path(f"{root}/bin/conda")
    if not known:
        raise unknown(f"whether Miniforge is installed at {root}")
    installed = bool(conda and conda["type"] in ("file", "link") and conda["mode"] & 0o111)
    if installed and (snap.content(f"{root}/{d.MINIFORGE_MARKER}")[1] or "").strip() == version:
        return root
    url, sha256 = host.data.get("pyenv_miniforge_url"), host.data.get("pyenv_miniforge_sha256")
    download_dir = host.data.get("pyenv_download_dir").rstrip("/")
    installer = f"{download_dir}/{url.rsplit('/', 1)[-1]}"
    part = f"{installer}.part"
    apt.packages(name="curl for the Miniforge download", packages=["curl", "ca-certificates"])
    server.shell(
        name=f"Miniforge {version} at {root} (sha256 checked before the installer runs)",
        commands=[
            cmd("mkdir", "-p", download_dir),
            cmd("curl", "-fsSL", "--retry", "3", "-o", part, url),
            chain(cmd("echo", f"{sha256}  {part}"), cmd("sha256sum", "--check", "--strict", "-"), op="|"),
            cmd("mv", part, installer),
            cmd("bash", installer, "-b", *(["-u"] if installed else []), "-p", root),
            to_file(cmd("printf", "%s\\n", version), f"{root}/{d.MINIFORGE_MARKER}"),
            cmd("rm", "-f", installer),
        ],
    )
    return root


def _conda_env(env: str, py: str, python: str, snap: Snapshot) -> None:
    root = _miniforge(snap)
    probed = snap.env(py)
    if probed is None:
        raise unknown(f"the Python of {env}")
    current = ".".join((probed["python"] or "").split(".")[:2]) or None  # major.minor, None: no env
    if current is None:
        channel = host.data.get("pyenv_conda_channel")
        server.shell(
            name=f"conda env {env} (python {python})",
            commands=[
                cmd(
                    root + "/bin/conda",
                    "create",
                    "-y",
                    "-p",
                    env,
                    "--override-channels",
                    "-c",
                    channel,
                    f"python={python}",
                )
            ],
        )
    elif current != python:
        raise EnvMismatch(
            f"host {host.name}: {env} has Python {current}, the spec asks for install.python {python}. "
            f"Fix: set install.python: \"{current}\", or remove {env} on the host to have it recreated."
        )


@deploy("Python environment", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def pyenv(spec: dict, where: Paths) -> None:
    ins = spec["install"]
    env = where["env"]
    snap = role_state(state_query(spec, where))  # the deploy's read, or one of its own
    directory(name="Install prefix", path=ins["prefix"], user="root", group="root", mode=d.PREFIX_MODE)
    cuda = ins["accelerator"] == "cuda"
    if ins["env_manager"] == "venv":
        _venv(env, where["python"], cuda, snap)
    else:
        if cuda and host.data.get("pyenv_cuda_conda_packages"):
            common_packages(
                name="C compiler Triton builds with",
                packages=list(host.data.get("pyenv_cuda_conda_packages")),
                update=False,
            )
        _conda_env(env, where["python"], str(ins["python"]), snap)
