"""Runs on a host with the env's python after an install: NAME is at version WANT and vLLM imports.

python verify_vllm.py NAME WANT
"""

import importlib.metadata as m, sys

name, want = sys.argv[1], sys.argv[2]
have = m.version(name)
assert have == want, f"{name} {have} installed, {want} wanted"
import transformers, vllm

print(name, have, "imports fine")
