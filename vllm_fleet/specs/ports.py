"""Fixed ports the spec checks and the renderer both know (a core constant module: the spec stage
does not depend on the renderer)."""

#: Ray's ports besides the GCS port (parallel.ray_port), fixed so that a firewall can name them
#: (Ray picks most of them at random otherwise). Ray has no authentication: vllm_fleet/roles/ray allows them
#: only from the cluster's own addresses. Worker processes take one port each from the range.
RAY_FIXED_PORTS = {
    "node_manager": 6380,
    "object_manager": 6381,
    "runtime_env_agent": 6382,
    "dashboard_agent_grpc": 6383,
    "metrics_export": 6384,
    "dashboard": 8265,  # head only; bound to 127.0.0.1 as well
    "ray_client_server": 10001,  # head only
    "dashboard_agent_listen": 52365,
}
RAY_WORKER_PORTS = (10002, 10999)
