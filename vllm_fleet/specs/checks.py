"""Semantic checks beyond the JSON Schema.

Two kinds: checks of the spec alone (this module: conflicting options, multi-node wiring, flags
vllm-fleet owns, secrets) and checks against model and GPU facts (:mod:`vllm_fleet.specs.hwchecks`,
which needs the catalogues). :func:`run` runs both. Every problem names its YAML path, says why,
and says what to do.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from vllm_fleet.specs.document import HOST_PATH, ROUTER_POLICY, Problem, Spec
from vllm_fleet.specs.ports import RAY_FIXED_PORTS, RAY_WORKER_PORTS

#: The schema's pattern for model.served_name (the name taken from `source` must fit it too).
SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}\Z")
#: vLLM flags that read more arguments from a file (any owned flag could hide there).
CONFIG_FLAGS = {"--config"}

# vLLM flags that vllm-fleet renders from their own spec keys: setting them again through
# engine.extra_args would contradict the spec (or, for the key, leak a secret into argv).
OWNED_FLAGS = {
    "--api-key": "server.api_key",
    "--host": "server.host",
    "--port": "server.port",
    "--shutdown-timeout": "server.shutdown_timeout",
    "--served-model-name": "model.served_name",
    "--model": "model.source",
    "--dtype": "model.dtype",
    "--quantization": "model.quantization",
    "-q": "model.quantization",
    "--max-model-len": "model.max_model_len",
    "--gpu-memory-utilization": "engine.gpu_memory_utilization",
    "--max-num-seqs": "engine.max_num_seqs",
    "--max-num-batched-tokens": "engine.max_num_batched_tokens",
    "--kv-cache-dtype": "engine.kv_cache_dtype",
    "--enforce-eager": "engine.enforce_eager",
    "--enable-prefix-caching": "engine.enable_prefix_caching",
    "--no-enable-prefix-caching": "engine.enable_prefix_caching",
    "--enable-chunked-prefill": "engine.enable_chunked_prefill",
    "--no-enable-chunked-prefill": "engine.enable_chunked_prefill",
    "--tensor-parallel-size": "parallel.tensor",
    "-tp": "parallel.tensor",
    "--pipeline-parallel-size": "parallel.pipeline",
    "-pp": "parallel.pipeline",
    "--data-parallel-size": "parallel.data",
    "-dp": "parallel.data",
    "--distributed-executor-backend": "parallel.backend",
    "--speculative-config": "engine.speculative",
    "--kv-offloading-size": "engine.kv_offload.size_gib",
    "--kv-offloading-backend": "engine.kv_offload.backend",
    "--disable-hybrid-kv-cache-manager": "engine.kv_offload (written on the vLLM versions whose offloading needs it)",
    "--trust-remote-code": "model.trust_remote_code",
    "--revision": "model.revision",
}
REMOVED_FLAGS = {
    "--swap-space": (
        "removed from vLLM (gone in 0.32/0.33); lower max_model_len or max_num_seqs, quantize, or add GPUs instead"
    ),
}
#: Headers that frame the request or belong to one connection: never a session key.
HOP_HEADERS = {
    "connection",
    "content-length",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "keep-alive",
    "proxy-connection",
    "host",
    "expect",
}
SECRET_ENV = {
    "VLLM_API_KEY": "server.api_key",
    "HF_TOKEN": "model.hub_token",
    "HUGGING_FACE_HUB_TOKEN": "model.hub_token",
}


def _flag(arg: str) -> str:
    """The flag an extra argument means to vLLM: `--api_key=x` is `--api-key` (vLLM's parser
    turns `_` into `-` in a long option's name and splits `--flag=value`)."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return name
    name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    # argparse also takes an unambiguous abbreviation (`--tensor-parallel` for
    # `--tensor-parallel-size`): a prefix of exactly one owned flag is read as that flag.
    if name not in OWNED_FLAGS and name not in CONFIG_FLAGS and len(name) > 4:
        longer = [f for f in OWNED_FLAGS if f.startswith(name)]
        if len(longer) == 1:
            return longer[0]
    return name


def raw_model_keys(spec: Spec | None) -> dict[str, Any]:
    return ((spec.raw.get("model") if spec else None) or {}) if spec else {}


#: How a rule reports: ``add(path, message, fix, severity="error")``.
Add = Callable[..., None]
#: One rule of the spec alone: it reads the resolved spec (and the user's own keys in ``spec``)
#: and reports each problem it finds through ``add``.
Rule = Callable[[dict[str, Any], "Spec | None", Add], None]


def _multi_node_wiring(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """A multi-node server needs a multi-node backend and the head's address; `native` needs several nodes."""
    par, ins, hw = r["parallel"], r["install"], r["hardware"]
    if par["nodes"] > 1:
        if par["backend"] == "mp":
            add(
                "parallel.backend",
                f"`mp` runs on one node, but parallel.nodes is {par['nodes']}",
                "set `backend: ray` (a Ray cluster; TP = GPUs per node, PP = nodes) or `backend: native` (vLLM's "
                "Ray-free multi-node mode)",
            )
        if par["backend"] == "native" and ins["accelerator"] == "cpu":
            add(
                "parallel.backend",
                f"`native` multi-node needs `vllm serve --headless` on the {par['nodes'] - 1} worker node(s), "
                "which the CPU build's module entry point does not offer",
                "set `backend: ray` for a multi-node CPU server (deployments/lab-tiny-pp2.yaml), or `nodes: 1`",
            )
        if not par.get("head_address"):
            add(
                "parallel.head_address",
                f"a {par['nodes']}-node server needs the head node's private address",
                "set `head_address:` to the Ray head / master node's address on the cluster network",
            )
        if par["tensor"] > hw["gpus_per_node"]:
            add(
                "parallel.tensor",
                f"tensor parallel {par['tensor']} spans nodes ({hw['gpus_per_node']} GPUs per node): TP across nodes "
                "is slow",
                f"use TP = GPUs per node ({hw['gpus_per_node']}) and PP = nodes ({par['nodes']})",
                "warning",
            )
    elif par["backend"] == "native":
        add(
            "parallel.backend",
            "`native` is vLLM's multi-node mode, but parallel.nodes is 1",
            "use `backend: mp` on one node",
        )


def _ray_ports(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """On a Ray cluster, vLLM's, nginx's and the GCS's ports stay off Ray's pinned ports and worker range."""
    par, srv, prx = r["parallel"], r["server"], r["proxy"]
    if not (par["nodes"] > 1 and par["backend"] == "ray"):
        return
    rp, lo, hi = int(par["ray_port"]), *RAY_WORKER_PORTS
    taken = {
        **{v: f"Ray's {k} port (pinned for the firewall)" for k, v in RAY_FIXED_PORTS.items()},
        int(srv["port"]): "server.port (vLLM, on the head)",
    }
    if prx["enabled"]:
        taken[int(prx["listen"])] = "proxy.listen (nginx, on the head)"
    ray_own = {v: k for k, v in RAY_FIXED_PORTS.items()}
    for key, port in (
        ("server.port", int(srv["port"])),
        ("proxy.listen", int(prx["listen"]) if prx["enabled"] else None),
    ):
        if port in ray_own:
            add(
                key,
                f"{port} is also Ray's {ray_own[port]} port (pinned for the firewall) on every Ray node: one of the "
                "two cannot bind it",
                f"pick a port outside Ray's ports ({', '.join(str(p) for p in sorted(ray_own))}) and {lo}-{hi}",
            )
        elif port is not None and lo <= port <= hi:
            add(
                key,
                f"{port} is inside Ray's worker port range {lo}-{hi}: a Ray worker process may take it first",
                f"pick a port outside {lo}-{hi} (e.g. 8000 for vLLM, 80 or 443 for nginx)",
            )
    if rp in taken:
        add(
            "parallel.ray_port",
            f"{rp} is also {taken[rp]}: the head's GCS could not bind it",
            f"pick a free port outside {', '.join(str(p) for p in sorted(taken))} and {lo}-{hi} "
            "(e.g. the default 6379)",
        )
    elif lo <= rp <= hi:
        add(
            "parallel.ray_port",
            f"{rp} is inside Ray's worker port range {lo}-{hi}: a worker process may take it first",
            f"pick a port outside {lo}-{hi} (e.g. the default 6379)",
        )


def _native_master_port(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """A `native` multi-node server's rendezvous port is not vLLM's API port."""
    par, srv = r["parallel"], r["server"]
    if par["nodes"] > 1 and par["backend"] == "native" and int(par["master_port"]) == int(srv["port"]):
        add(
            "parallel.master_port",
            f"{par['master_port']} is also server.port on the head",
            "use different ports (default master_port 29501)",
        )


def _engine_batching(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """The batch limits: one prompt must prefill in one step without chunking; realtime keeps batches small."""
    m, e = r["model"], r["engine"]
    mbt = e.get("max_num_batched_tokens")
    if mbt is not None and not e["enable_chunked_prefill"] and mbt < m["max_model_len"]:
        add(
            "engine.max_num_batched_tokens",
            f"{mbt} is below max_model_len {m['max_model_len']} with chunked prefill off: vLLM refuses a prompt it "
            "cannot prefill in one step",
            f"raise it to at least {m['max_model_len']}, or set `enable_chunked_prefill: true`",
        )
    if e["profile"] == "realtime" and e["max_num_seqs"] > 32:
        add(
            "engine.max_num_seqs",
            f"{e['max_num_seqs']} sequences at once with the realtime profile: latency grows with the batch",
            "keep realtime max_num_seqs in 16-32, or use `profile: batch`",
            "warning",
        )


def _kv_offload(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """The CPU tier of the KV cache: CUDA builds only (the CPU build's KV cache is host memory
    already), and with prefix caching on (the tier holds evicted prefixes for later hits)."""
    e = r["engine"]
    size = e["kv_offload"]["size_gib"]
    if size == 0:
        return
    if r["install"]["accelerator"] == "cpu":
        add(
            "engine.kv_offload.size_gib",
            "the CPU build keeps its whole KV cache in host memory already (engine.cpu_kv_cache_gib): "
            "a second tier in the same memory has nothing to offload to",
            "remove engine.kv_offload, or raise engine.cpu_kv_cache_gib instead",
        )
    elif not e.get("enable_prefix_caching"):
        add(
            "engine.kv_offload.size_gib",
            "the tier keeps prefixes for later prefix-cache hits, and prefix caching is off",
            "set `engine.enable_prefix_caching: true`, or remove engine.kv_offload",
        )


def _extra_args(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """engine.extra_args may not set again what the spec owns, read flags from a file, carry the key, or use removed
    flags."""
    for i, arg in enumerate(r["engine"]["extra_args"]):
        flag = _flag(arg)
        path = f"engine.extra_args[{i}]"
        if flag in CONFIG_FLAGS:
            add(
                path,
                f"`{arg.split('=', 1)[0]}` reads vLLM's arguments from a file, where any flag vllm-fleet owns (and "
                "the API key) could be set again",
                "delete it; set each option in its own spec key, or list the other flags here one by one",
            )
        elif flag in REMOVED_FLAGS:
            add(path, f"`{flag}` was {REMOVED_FLAGS[flag]}", f"delete `{arg}`")
        elif flag == "--api-key":
            add(
                path,
                "an API key in the command line is visible to every user of the host (ps, /proc, the journal)",
                "delete it (and its value) here; set `server.api_key: {file: PATH}`: the key goes to a 0600 "
                "EnvironmentFile as VLLM_API_KEY",
            )
        elif flag in OWNED_FLAGS:
            spelled = arg.split("=", 1)[0]
            also = f" (vLLM reads `{spelled}` as `{flag}`)" if spelled != flag else ""
            add(
                path,
                f"`{flag}` is rendered by vllm-fleet from `{OWNED_FLAGS[flag]}`{also}",
                f"delete it here and set `{OWNED_FLAGS[flag]}` instead",
            )


def _model_transfer(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """The hub's keys (revision, hub_fetch, hub_token) only where the weights come from the hub; a path is not a hub
    id."""
    m = r["model"]
    if m["transfer"] == "none" and "revision" in raw_model_keys(spec):
        add(
            "model.revision",
            "a revision is set but the weights are not downloaded (transfer: none)",
            "remove it",
            "warning",
        )
    if m["transfer"] == "hub" and not m.get("revision"):
        add(
            "model.revision",
            "no revision pinned: the hub's `main` is downloaded, and a re-deploy may download different weights",
            "set `revision:` to a commit hash of the model repository",
            "warning",
        )
    if "hub_fetch" in raw_model_keys(spec) and m["transfer"] != "hub":
        add(
            "model.hub_fetch",
            f"set but the weights are not downloaded from the hub (transfer: {m['transfer']})",
            "remove it",
            "warning",
        )
    if m.get("hub_token") and m["transfer"] != "hub":
        add(
            "model.hub_token",
            f"a hub token is set but the weights are not downloaded (transfer: {m['transfer']})",
            "remove it",
            "warning",
        )
    if m["transfer"] != "none" and m.get("local_dir") is None and m["source"].startswith(("/", "./", "../", "~")):
        add(
            "model.transfer",
            "a path source cannot be downloaded from the hub",
            "use `transfer: upload` (copy from this machine) or `transfer: none` (already on the hosts)",
        )


def _model_names(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """What `source` stands in for when the user left `path` or `served_name` out must fit those keys."""
    m = r["model"]
    raw_model = raw_model_keys(spec)
    if m["transfer"] == "none" and "path" not in raw_model and not HOST_PATH.search(str(m.get("path", ""))):
        add(
            "model.source",
            f"with `transfer: none` the weights are read at `source` on every host, but {m['source']!r} is not a "
            "plain absolute path there",
            "set `source:` (or `path:`) to the absolute directory of the weights on the hosts (e.g. /srv/models/x), "
            "or use `transfer: hub` for a hub id",
        )
    if "served_name" not in raw_model and spec is not None and not SERVED_NAME.search(str(m.get("served_name", ""))):
        add(
            "model.served_name",
            f"the name taken from `source` ({m['served_name']!r}) is not a plain model name",
            "set `served_name:` (letters, digits and ._:/-, starting with a letter or digit)",
        )


def _api_key(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """The proxy's key check needs a key; no key at all is an open API."""
    srv, prx = r["server"], r["proxy"]
    if prx["enabled"] and prx["auth"] == "api_key" and not srv.get("api_key"):
        add(
            "proxy.auth",
            "the proxy checks an API key, but server.api_key is not set",
            "set `server.api_key: {file: PATH, generate: true}`, or `proxy.auth: none` to leave the API open",
        )
    if not srv.get("api_key"):
        add(
            "server.api_key",
            "no API key: anyone who reaches the port can use the model",
            "set `api_key: {file: PATH, generate: true}`",
            "warning",
        )


def _server_binding(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """vLLM's port and address: not nginx's port, not privileged, reachable the way the proxy (or its absence) needs."""
    par, srv, prx = r["parallel"], r["server"], r["proxy"]
    if prx["enabled"] and prx["listen"] == srv["port"]:
        where = (
            "the same host"
            if par["nodes"] == 1
            else "the head (nginx runs there unless the inventory has a proxy group)"
        )
        add(
            "proxy.listen",
            f"nginx and vLLM both want port {srv['port']} on {where}",
            "use different ports (e.g. proxy.listen 80 or 443, server.port 8000)",
        )
    if int(srv["port"]) < 1024:
        add(
            "server.port",
            f"{srv['port']} is a privileged port, but vLLM runs as `{srv['user']}` without capabilities "
            "(CapabilityBoundingSet= is empty): it cannot bind it",
            "use a port of 1024 or above (default 8000); put nginx (proxy.listen) on 80 or 443",
        )
    if srv["host"] not in ("127.0.0.1", "0.0.0.0"):
        # one address for every server host cannot be each host's own; and on each host the
        # deploy reaches vLLM on loopback (its health wait, the smoke test, the rollout's drain,
        # the liveness probe), as nginx does on the same host
        add(
            "server.host",
            f"vLLM would listen on {srv['host']} alone, but the deploy reaches each replica on its own host through "
            "127.0.0.1 (the health wait, the smoke test, the rollout's drain, the liveness probe)"
            + (", and so does nginx on the same host" if prx["enabled"] and par["nodes"] == 1 else ""),
            "leave server.host unset (127.0.0.1 with the proxy on the same host, else 0.0.0.0), or set 0.0.0.0: "
            "behind a proxy the deploy's nftables rules then let only the proxy hosts reach the port",
        )
    if not prx["enabled"] and srv["host"] == "127.0.0.1":
        add(
            "server.host",
            "with the proxy off, vLLM on 127.0.0.1 answers only on the host itself",
            "set `server.host: 0.0.0.0` (and firewall it), or enable the proxy",
            "warning",
        )


def _tls(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """TLS on needs one certificate source (given or self-signed); TLS settings with TLS off are a slip."""
    tls = r["proxy"]["tls"]
    if tls["enabled"] and not tls["self_signed"] and not (tls.get("certificate") and tls.get("certificate_key")):
        add(
            "proxy.tls",
            "TLS is on but no certificate is given",
            "set `certificate:` and `certificate_key:`, or `self_signed: true` for a lab",
        )
    if tls["enabled"] and tls["self_signed"] and tls.get("certificate"):
        add("proxy.tls.self_signed", "both a certificate and self_signed are set", "keep one")
    if (tls.get("certificate") or tls.get("self_signed")) and not tls["enabled"]:
        add(
            "proxy.tls.enabled",
            "TLS settings are present but TLS is off",
            "set `enabled: true` or remove them",
            "warning",
        )


def _routing(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """proxy.routing (`balance` is its older name): one policy, and a session header a client can send."""
    raw_prx = (spec.raw.get("proxy") or {}) if spec else {}
    raw_rt = raw_prx.get("routing") or {}
    rt = r["proxy"]["routing"]
    if raw_prx.get("balance") and raw_rt.get("policy") and raw_rt["policy"] != raw_prx["balance"]:
        add(
            "proxy.balance",
            f"proxy.balance ({raw_prx['balance']}) and proxy.routing.policy ({raw_rt['policy']}) disagree",
            "remove `balance:` (routing.policy replaces it)",
        )
    if rt["session_header"].lower() in HOP_HEADERS:
        add(
            "proxy.routing.session_header",
            f"{rt['session_header']} is an HTTP framing/hop-by-hop header, not one a client can use to name a "
            "conversation",
            "use a header of your own, e.g. X-Session-Id (the default)",
        )


def _router_ports(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """The cache-aware router's ports: free on the proxy host and outside the replicas' port range."""
    srv, prx = r["server"], r["proxy"]
    if not (prx["enabled"] and prx["routing"]["policy"] in (ROUTER_POLICY, "auto")):  # auto: decided in the layout
        return
    router = prx["routing"]["router"]
    used = {int(prx["listen"]): "proxy.listen", int(srv["port"]): "server.port"}
    for key in ("port", "metrics_port"):
        port = int(router[key])
        if port in used:
            add(
                f"proxy.routing.router.{key}",
                f"port {port} is also {used[port]}'s: the router and it cannot both bind it on the proxy host",
                f"pick a free port for `proxy.routing.router.{key}` (defaults 8190 and 8191)",
            )
        used.setdefault(port, f"proxy.routing.router.{key}")
    lo, hi = int(srv["port"]), int(srv["port"]) + 15
    for key in ("port", "metrics_port"):
        if lo < int(router[key]) <= hi:
            add(
                f"proxy.routing.router.{key}",
                f"port {router[key]} is in server.port's replica range ({lo}-{hi}: replica N listens on server.port + "
                "N)",
                f"pick a port outside {lo}-{hi} (defaults 8190 and 8191)",
            )


def _rollout(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """The rollout section as the user wrote it (resolve fills batch_size in): one batch size, single-node replicas."""
    par = r["parallel"]
    raw_ro = ((spec.raw.get("rollout") if spec else None) or {}) if spec else (r.get("rollout") or {})
    if "batch_percent" in raw_ro and "batch_size" in raw_ro:
        add("rollout.batch_percent", "both batch_size and batch_percent are set", "keep one of them")
    if raw_ro and par["nodes"] > 1:
        add(
            "rollout",
            f"a rolling update replaces single-node replicas, but parallel.nodes is {par['nodes']}",
            "remove the rollout section (a multi-node server is one replica: redeploy it with deploys/serve.py)",
        )


def _accelerator(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """install.accelerator and hardware.gpu agree (cpu with cpu, cuda with a named GPU)."""
    ins, hw = r["install"], r["hardware"]
    if ins["accelerator"] == "cpu" and hw.get("gpu") not in (None, "cpu"):
        add(
            "hardware.gpu",
            f"accelerator is `cpu` but hardware.gpu is `{hw['gpu']}`",
            "set `hardware.gpu: cpu`, or `install.accelerator: cuda` for GPU hosts",
        )
    if ins["accelerator"] == "cuda" and hw.get("gpu") == "cpu":
        add(
            "install.accelerator",
            "hardware.gpu is `cpu` but accelerator is `cuda`",
            "set `install.accelerator: cpu` (vLLM's CPU build) or name the GPU in hardware.gpu",
        )
    if ins["accelerator"] == "cuda" and not hw.get("gpu"):
        add(
            "hardware.gpu",
            "no GPU type: the memory plan and the FP8/Marlin checks cannot run",
            "set `hardware.gpu:` (see `vllm-fleet plan --list-gpus`)",
            "warning",
        )


def _driver_branch(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """The NVIDIA driver branch is new enough for the CUDA that vLLM's wheels are built for."""
    ins = r["install"]
    nv = ins.get("nvidia") or {}
    if not (
        ins["accelerator"] == "cuda"
        and nv.get("min_driver_branch")
        and int(nv["driver_branch"]) < int(nv["min_driver_branch"])
    ):
        return
    why = f"vLLM {ins['vllm_version']}'s wheels are built for CUDA {nv['vllm_cuda']}"
    if nv["cuda_version"] != nv["vllm_cuda"]:
        why += f" and install.nvidia.cuda_version is {nv['cuda_version']}"
    fix = (
        f"set `driver_branch: \"{nv['min_driver_branch']}\"` or newer (or leave it out: the default follows "
        "install.vllm_version)"
    )
    if nv["vllm_cuda"].startswith("13"):
        fix += ", or pin `install.vllm_version` below 0.20 (CUDA 12.8 wheels, driver branch 570)"
    if nv.get("source") == "distro":
        fix += "; Debian 12's own driver is branch 535: use `source: nvidia` (NVIDIA's repository) for a newer one"
    add(
        "install.nvidia.driver_branch",
        f"driver branch {nv['driver_branch']} cannot run this vLLM: {why}, which needs driver branch "
        f"{nv['min_driver_branch']} or newer",
        fix,
    )


def _package_source(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """Packages come from one place: an offline wheelhouse or an index."""
    ins = r["install"]
    if ins.get("wheelhouse") and ins.get("index_url"):
        add(
            "install.index_url",
            "an offline wheelhouse and an index URL are both set: the wheelhouse installs with --no-index",
            "keep one of them",
        )


def _secret_env(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """Secrets have their own keys: `env` is written to a readable file."""
    for key in r["env"]:
        if key in SECRET_ENV:
            add(
                f"env.{key}",
                f"{key} is a secret; env values are written to a readable file",
                f"use `{SECRET_ENV[key]}` (a secret reference written to a 0600 file)",
            )


def _monitoring(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """Monitoring's ports are its own, and its GPU memory alert sits above what vLLM reserves."""
    mon = r["monitoring"]
    if not mon["enabled"]:
        return
    e, srv, prx, ins = r["engine"], r["server"], r["proxy"], r["install"]
    ports = {
        "server.port": srv["port"],
        "proxy.listen": prx["listen"],
        "monitoring.prometheus_port": mon["prometheus_port"],
        "monitoring.node_exporter_port": mon["node_exporter_port"],
        "monitoring.dcgm_exporter_port": mon["dcgm_exporter_port"],
    }
    seen: dict[int, str] = {}
    for key, port in ports.items():
        if port in seen and key.startswith("monitoring."):
            add(key, f"port {port} is also {seen[port]}'s: both may run on one host", f"pick another port for `{key}`")
        seen.setdefault(port, key)
    util = e.get("gpu_memory_utilization")
    if ins["accelerator"] == "cuda" and util and mon["alerts"]["gpu_memory_usage"] <= util:
        add(
            "monitoring.alerts.gpu_memory_usage",
            f"{mon['alerts']['gpu_memory_usage']} is not above engine.gpu_memory_utilization {util}: vLLM reserves "
            "that much up front, so the alert would always fire",
            f"set it above {util} (e.g. 0.98)",
            "warning",
        )


def _control_paths(r: dict[str, Any], spec: Spec | None, add: Add) -> None:
    """Every path on the control machine the spec names can be read here (spec.localpath).
    Needs the spec file (relative paths are taken from its directory): a resolved dict alone is
    not judged against this machine."""
    from vllm_fleet.specs import localpath

    if spec is not None:
        localpath.control_path_problems(r, spec.base_dir, add)


#: The checks of the spec alone, in the order their problems are reported.
SPEC_RULES: tuple[Rule, ...] = (
    # parallelism wiring
    _multi_node_wiring,
    _ray_ports,
    _native_master_port,
    # engine
    _engine_batching,
    _kv_offload,
    _extra_args,
    # model
    _model_transfer,
    _model_names,
    # server / proxy
    _api_key,
    _server_binding,
    _tls,
    _routing,
    _router_ports,
    # rollout, install, env, monitoring
    _rollout,
    _accelerator,
    _driver_branch,
    _package_source,
    _secret_env,
    _monitoring,
    # paths on the control machine
    _control_paths,
)


def spec_problems(r: dict[str, Any], spec: Spec | None = None) -> list[Problem]:
    """Checks that need only the resolved spec: every rule of :data:`SPEC_RULES`, in order."""
    out: list[Problem] = []

    def add(path: str, message: str, fix: str, severity: str = "error") -> None:
        out.append(Problem(path, message, fix, severity, spec.line(path) if spec else None))

    for rule in SPEC_RULES:
        rule(r, spec, add)
    return out


def run(resolved: dict[str, Any], spec: Spec | None = None, *, hardware: bool = True) -> list[Problem]:
    """All semantic problems: the spec's own, then (when ``hardware``) model/GPU facts."""
    problems = spec_problems(resolved, spec)
    if hardware:
        try:
            from vllm_fleet.specs import hwchecks
        except ImportError:  # pragma: no cover - only while the catalogue is being built
            return problems
        problems += hwchecks.hardware_problems(resolved, spec)
    return problems
