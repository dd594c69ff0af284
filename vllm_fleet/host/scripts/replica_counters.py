"""Runs on a replica's host (vllm_fleet.serving.multiturn.prefix_counters): its /metrics from
loopback, only the counters wanted, summed over their label sets (one JSON line).

    python3 replica_counters.py PORT '["vllm:prefix_cache_hits_total", ...]'
"""
import json, sys, urllib.request
want = set(json.loads(sys.argv[2]))
text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % int(sys.argv[1]), timeout=10).read().decode()
out = {}
for line in text.splitlines():
    if line.startswith("#"):
        continue
    name = line.split("{", 1)[0].split(" ", 1)[0]
    if name in want:
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
print(json.dumps(out))
