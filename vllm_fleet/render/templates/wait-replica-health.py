#!/usr/bin/env python3
"""ExecStartPre of a vLLM replica that shares its GPUs with one started before it
(replicas.per_gpu): wait until that one answers /health, so that this vLLM's start-up memory
check (free GPU memory >= its --gpu-memory-utilization share) sees the memory it took.

    wait-replica-health PORT TIMEOUT_SECONDS

Exit 0 once http://127.0.0.1:PORT/health answers 200; exit 1 naming the port after TIMEOUT
(the unit then fails and systemd retries it). Rendered by vllm-fleet; standard library only.
"""

import sys
import time
import urllib.request

port, deadline = int(sys.argv[1]), time.time() + float(sys.argv[2])
while time.time() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
        sys.exit(0)
    except Exception:
        time.sleep(2)
sys.exit(
    f"wait-replica-health: the replica on port {port} (same GPUs, started first) is not healthy after {sys.argv[2]} s"
)
