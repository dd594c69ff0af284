"""vllm-fleet: declarative provisioning of vLLM serving fleets on pyinfra."""

__version__ = "0.1.0"
