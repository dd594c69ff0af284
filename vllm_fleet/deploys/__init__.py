"""The deploys pyinfra runs, as functions of the installed package (one call per inventory host).

    pyinfra -y INVENTORY vllm_fleet.deploys.serve.serve           # what deploys/serve.py runs
    pyinfra -y INVENTORY vllm_fleet.deploys.rollout.rollout_step  # one step of `vllm-fleet rollout`

The checkout's deploys/*.py are thin entry points that call these.
"""
