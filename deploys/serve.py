"""Everything, in order: bare hosts -> a smoke-tested vLLM service behind nginx.

    pyinfra -y inventory/lab.py deploys/serve.py

A thin entry point: the deploy is :func:`vllm_fleet.deploys.serve.serve` (its docstring says
where the spec comes from and what each group gets); an installed package runs the same with
`pyinfra INVENTORY vllm_fleet.deploys.serve.serve`.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("vllm_fleet") is None:  # a checkout without `pip install`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_fleet.deploys.serve import serve  # noqa: E402

serve()
