"""Runs on a replica's host (vllm_fleet.serving.multiturn.prefix_counters): its /metrics from
loopback, only the counters wanted, summed over their label sets (one JSON line). A wanted name
with a transfer type, ``NAME{transfer_type=cpu_to_gpu}``, sums only the series with that
``transfer_type`` label (any case): vLLM's KV offload bytes by direction.

    python3 replica_counters.py PORT '["vllm:prefix_cache_hits_total", ...]'
"""

import json, re, sys, urllib.request

want = set(json.loads(sys.argv[2]))
text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % int(sys.argv[1]), timeout=10).read().decode()
out = {}
for line in text.splitlines():
    if line.startswith("#"):
        continue
    name = line.split("{", 1)[0].split(" ", 1)[0]
    t = re.search(r'transfer_type="([^"]*)"', line.rsplit(" ", 1)[0])
    for key in (name, "%s{transfer_type=%s}" % (name, t.group(1).lower()) if t else None):
        if key in want:
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
print(json.dumps(out))
