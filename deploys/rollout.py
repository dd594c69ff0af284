"""One step of a rolling update (`vllm-fleet rollout` runs it per step, in its own batch order).

A thin entry point: the step is :func:`vllm_fleet.deploys.rollout.rollout_step` (its docstring
says what each step does and which environment variables drive it).
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("vllm_fleet") is None:  # a checkout without `pip install`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_fleet.deploys.rollout import rollout_step  # noqa: E402

rollout_step()
