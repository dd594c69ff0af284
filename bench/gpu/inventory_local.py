"""pyinfra inventory for the GPU proof: the GPU machine deploys to itself (`@local`), as the one
vLLM server of the spec in $VLLM_FLEET_SPEC.

    VLLM_FLEET_SPEC=deployments/h200-qwen7b-bf16.yaml pyinfra -y bench/gpu/inventory_local.py bench/gpu/deploy_gpu.py
"""

servers = ["@local"]
