"""Runs inside the vLLM CPU venv (vllm_fleet.lab.vllmcpu.check_serve_args_many): for each case,
parse its args with vLLM's own `vllm serve` parser, run its pre-load validation, build
EngineArgs (and, on request, the engine config) and report what vLLM understood, or the error
(argparse exits 2 on an unknown flag or bad value).

    python -I vllm_parser_check.py CASES_JSON
"""

import contextlib, io, json, os, sys, traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
cases = json.loads(sys.argv[1])
from vllm.utils.argparse_utils import FlexibleArgumentParser

try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:  # older layouts
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs

KEYS = [
    "model",
    "served_model_name",
    "max_model_len",
    "dtype",
    "quantization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "enforce_eager",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "distributed_executor_backend",
    "speculative_config",
    "trust_remote_code",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "kv_offloading_size",
    "kv_offloading_backend",
    "disable_hybrid_kv_cache_manager",
]


def check(case):
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(case["args"])
    except SystemExit as exc:
        return {"returncode": exc.code, "stage": "parse", "error": err.getvalue().strip().splitlines()[-1:]}
    stage = "validate"
    try:
        validate_parsed_serve_args(args)
        if getattr(args, "model_tag", None):  # what `vllm serve MODEL` does
            args.model = args.model_tag
        stage = "engine_args"
        ea = AsyncEngineArgs.from_cli_args(args)
        out = {
            "returncode": 0,
            "engine_args": {k: getattr(ea, k, None) for k in KEYS},
            "frontend": {k: getattr(args, k, None) for k in ("host", "port", "api_key", "headless")},
        }
        if case.get("engine_config"):
            stage = "engine_config"
            cfg = ea.create_engine_config()
            out["engine_config"] = {
                "max_model_len": cfg.model_config.max_model_len,
                "dtype": str(cfg.model_config.dtype),
                "served_model_name": cfg.model_config.served_model_name,
                "device": str(cfg.device_config.device),
                "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
                "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            }
        return out
    except Exception as exc:
        return {"returncode": 1, "stage": stage, "error": [f"{type(exc).__name__}: {exc}"]}


results = [check(c) for c in cases]
print("@@VLLM-FLEET-RESULT@@" + json.dumps(results, default=str))
