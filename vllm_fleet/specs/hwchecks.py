"""Checks of a resolved spec against model facts (catalogue or config.json) and GPU facts.

:func:`apply_model_facts` is a resolution step (run it before the checks): it caps a
``max_model_len`` that came from the engine profile at the model's context.
:func:`hardware_problems` returns every problem with its YAML path, why, and the fix.

Nothing here imports pyinfra or touches a host.
"""

from __future__ import annotations

from typing import Any

from vllm_fleet.specs import catalog

from vllm_fleet.specs import planner
from vllm_fleet.specs.document import Problem, Spec, did_you_mean

FP8_MIN_CC = 8.9  # FP8 compute: Ada Lovelace (sm_89) and Hopper (sm_90)
MARLIN_MIN_CC = 8.0  # Marlin kernels (awq_marlin, gptq_marlin): Ampere and newer
SMALL_MODEL_B = 14.0  # "small" for the speculative-decoding warning (the 000 article: a 7B)

# What a checkpoint's quantization_config allows as --quantization.
_COMPATIBLE = {
    "awq": {"awq", "awq_marlin"},
    "gptq": {"gptq", "gptq_marlin"},
    "fp8": {"fp8"},
    "compressed-tensors": {"compressed-tensors"},
    "bitsandbytes": {"bitsandbytes"},
}

OOM_FIX_ORDER = (
    "in this order (the 000 and 004 articles): 1) serve a quantized checkpoint (AWQ INT4, with "
    "`quantization: awq_marlin`) and confirm it is the one loaded; 2) lower "
    "engine.gpu_memory_utilization only if something else shares the GPU (0.95 -> 0.90); "
    "3) lower model.max_model_len (8192 -> 4096); 4) lower engine.max_num_seqs; 5) "
    "`kv_cache_dtype: fp8` on compute capability 8.9+ (Ada, Hopper); 6) add GPUs: raise "
    "parallel.tensor (and hardware.gpus_per_node)"
)


def apply_model_facts(resolved: dict[str, Any]) -> None:
    """Resolution step: cap a profile-derived max_model_len at the model's context, silently.

    An explicit ``model.max_model_len`` is left alone (a check reports it if it is too long).
    """
    m = resolved["model"]
    if not m.get("max_model_len_from_profile"):
        return
    facts, _ = catalog.facts_for(resolved)
    if facts and facts.get("context") and m["max_model_len"] > facts["context"]:
        m["max_model_len"] = facts["context"]


class _Facts:
    """What the hardware rules read (the resolved spec, its GPU, the model's facts) and the problems found so far."""

    def __init__(self, resolved: dict[str, Any], spec: Spec | None) -> None:
        self.r, self.spec = resolved, spec
        self.out: list[Problem] = []
        self.g: dict[str, Any] | None = None  # the GPU's catalogue entry, once :func:`_gpu` found it
        self.facts: dict[str, Any] | None = None  # the model's facts (catalogue or config.json)
        self.how = ""  # where the facts came from, or why there are none

    def add(self, path: str, message: str, fix: str, severity: str = "error") -> None:
        self.out.append(Problem(path, message, fix, severity, self.spec.line(path) if self.spec else None))

    @property
    def cpu(self) -> bool:
        return self.g is not None and self.g["name"] == "cpu"

    @property
    def cc(self) -> float | None:
        return self.g.get("compute_capability") if self.g else None


def _gpu(c: _Facts) -> None:
    """hardware.gpu names a catalogue GPU (found into ``c.g``) that suits install.accelerator."""
    hw, ins = c.r["hardware"], c.r["install"]
    gname = hw.get("gpu") or ("cpu" if ins["accelerator"] == "cpu" else None)
    if gname is None:
        c.add(
            "hardware.gpu",
            "no GPU named: the plan and the GPU checks cannot run",
            f"set `gpu:` under `hardware:` to one of: {', '.join(catalog.gpu_names())}",
            "warning",
        )
    else:
        try:
            c.g = catalog.gpu(gname)
        except KeyError:
            hint = did_you_mean(str(gname), catalog.gpu_names())
            c.add(
                "hardware.gpu",
                f"unknown GPU {gname!r}",
                (f"did you mean `{hint}`? " if hint else "")
                + f"known GPUs: {', '.join(catalog.gpu_names())} (vllm-fleet plan --list-gpus)",
            )
    if c.g is not None and ins["accelerator"] == "cuda" and c.cpu:
        c.add(
            "hardware.gpu",
            "install.accelerator is cuda but hardware.gpu is cpu",
            "name the GPU model (e.g. rtx3090), or set install.accelerator: cpu",
        )


def _gpu_count(c: _Facts) -> None:
    """Every GPU of every node is one rank of TP x PP x DP of one replica (replicas.per_host
    replicas on a node split its GPUs; vllm_fleet.render.layout gives each its own)."""
    if c.g is None or c.cpu:
        return
    resolved, par, hw = c.r, c.r["parallel"], c.r["hardware"]
    tp, pp, dp = par["tensor"], par["pipeline"], par["data"]
    reps = int(resolved["replicas"]["per_host"])
    share = planner.replicas_per_gpu(resolved)
    want = hw["gpus_per_node"] * par["nodes"]
    if share > 1 and reps % share:
        c.add(
            "replicas.per_gpu",
            f"replicas.per_host {reps} is not a multiple of replicas.per_gpu {share}: a GPU group would be shared by "
            "fewer",
            f"set per_host to a multiple of {share} (e.g. {share * max(1, reps // share)})",
        )
    elif share > 1 and par["nodes"] > 1:
        c.add(
            "replicas.per_gpu",
            "replicas share GPUs only on one node (parallel.nodes is above 1)",
            "remove replicas.per_gpu",
        )
    elif tp * pp * dp * (reps // share) != want:
        times = (f" x replicas.per_host {reps}" if reps > 1 else "") + (
            f" / replicas.per_gpu {share}" if share > 1 else ""
        )
        c.add(
            "parallel.tensor",
            f"tensor {tp} x pipeline {pp} x data {dp}{times} = {tp * pp * dp * (reps // share)} GPUs, but "
            f"hardware.gpus_per_node {hw.get('gpus_per_node', 1)} x parallel.nodes {par.get('nodes', 1)} = {want}",
            "make them equal: usually tensor = GPUs per node and pipeline = nodes (the 004 article); "
            "replicas.per_host for more replicas on one host (each its own GPUs), data for replicas inside one server",
        )


def _flashinfer(c: _Facts) -> None:
    """FlashInfer's kernels on hosts without internet (vllm_fleet.specs.flashinfer)."""
    if c.r["install"]["accelerator"] == "cuda" and not c.cpu:
        c.out.extend(flashinfer_problems(c.r, c.cc, c.spec))


def _precision(c: _Facts) -> None:
    """FP8, Marlin and plain AWQ/GPTQ against the GPU generation; INT8 KV cache anywhere."""
    m, e, g, cc = c.r["model"], c.r["engine"], c.g, c.cc
    quant, kv_dtype = m.get("quantization"), e["kv_cache_dtype"]
    if cc is not None:
        assert g is not None
        if kv_dtype.startswith("fp8") and cc < FP8_MIN_CC:
            c.add(
                "engine.kv_cache_dtype",
                f"FP8 KV cache needs compute capability {FP8_MIN_CC}+ (Ada Lovelace, Hopper); {g['label']} is "
                f"{g['arch']} sm_{int(cc * 10)} (the 000 article: 'FP8 KV cache is not supported on this device' on "
                "an RTX 3090)",
                "use `kv_cache_dtype: auto`; to free memory quantize the weights (AWQ INT4) or lower max_model_len",
            )
        if quant == "fp8" and cc < FP8_MIN_CC:
            c.add(
                "model.quantization",
                f"FP8 weights need compute capability {FP8_MIN_CC}+ (Ada Lovelace, Hopper); {g['label']} is "
                f"{g['arch']} sm_{int(cc * 10)} with no FP8 compute (vLLM would fall back to weight-only FP8 Marlin: "
                "memory savings, no FP8 speed-up, a path the articles do not vouch for)",
                "on Ampere serve an AWQ INT4 checkpoint with `quantization: awq_marlin`; use fp8 on compute "
                "capability 8.9+",
            )
        if quant in ("awq_marlin", "gptq_marlin") and cc < MARLIN_MIN_CC:
            c.add(
                "model.quantization",
                f"{quant} needs compute capability {MARLIN_MIN_CC}+ (Ampere or newer); {g['label']} is "
                f"sm_{int(cc * 10)}",
                f"use `quantization: {quant.replace('_marlin', '')}`",
            )
        if quant in ("awq", "gptq") and cc >= MARLIN_MIN_CC:
            c.add(
                "model.quantization",
                f"plain `{quant}` forces the slow {quant.upper()} kernel on a GPU that supports Marlin (measured ~8x "
                "slower decode than awq_marlin on an H200: 30.6 vs 3.8 ms per step)",
                f"use `quantization: {quant}_marlin` (or leave quantization unset: vLLM picks Marlin for "
                f"{quant.upper()} checkpoints)",
                "warning",
            )
    if kv_dtype == "int8":
        c.add(
            "engine.kv_cache_dtype",
            "INT8 KV cache collapsed accuracy in the 000 article (HellaSwag 80.5 % -> 65.5 %)",
            "use `kv_cache_dtype: auto` (or fp8 on compute capability 8.9+)",
            "warning",
        )


def _activation_dtype(c: _Facts) -> None:
    """AWQ / GPTQ kernels and their INT4 checkpoints run in float16."""
    m = c.r["model"]
    quant = m.get("quantization")
    if quant in ("awq", "gptq") and m.get("dtype") not in ("float16", "half", "auto"):
        c.add(
            "model.dtype",
            f"`{quant}` kernels run in float16 only; dtype is {m.get('dtype')}",
            "set `dtype: float16` (the 000 article's AWQ command uses --dtype float16)",
        )
    elif quant in ("awq_marlin", "gptq_marlin") and m.get("dtype") in ("bfloat16", "float32", "float"):
        c.add(
            "model.dtype",
            f"{quant} with dtype {m['dtype']}: INT4 checkpoints are calibrated in float16 and the articles serve them "
            "in float16",
            "set `dtype: float16`",
            "error" if m["dtype"] in ("float32", "float") else "warning",
        )


def _without_model_facts(c: _Facts) -> None:
    """No model facts: say which checks did not run (and the catalogue name meant), and the one check that still can."""
    m = c.r["model"]
    c.add(
        "model.architecture" if m.get("architecture") else "model.source",
        f"plan skipped: no model facts ({c.how}), so memory, head-divisibility and context checks did not run",
        "set `architecture:` under `model:` to a catalogue name (vllm-fleet plan --list-models) or make the model's "
        "config.json readable (for `transfer: upload`, build/download the directory first)",
        "warning",
    )
    if m.get("architecture") and not catalog.model(m["architecture"]):
        hint = did_you_mean(m["architecture"], catalog.model_names())
        if hint:
            last = c.out[-1]
            c.out[-1] = Problem(last.path, last.message, f"did you mean `{hint}`? " + last.fix, "warning", last.line)
    if speculative_small(c.r, None):
        c.add(
            "engine.speculative",
            "speculative decoding on a single GPU",
            "measure it first (the 000 article: no gain for a 7B, TTFT p99 x25 at concurrency 16)",
            "warning",
        )


def _heads(c: _Facts) -> None:
    """Tensor parallelism divides the attention heads, and suits the KV heads."""
    assert c.facts is not None
    tp = c.r["parallel"]["tensor"]
    heads, kvh = c.facts["heads"], c.facts["kv_heads"]
    if heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= 16]
        c.add(
            "parallel.tensor",
            f"tensor parallel {tp} does not divide the model's {heads} attention heads",
            f"use a divisor of {heads}: {', '.join(map(str, divisors))} (the 004 article: TP must divide the heads)",
        )
    elif kvh % tp and tp % kvh:
        c.add(
            "parallel.tensor",
            f"tensor parallel {tp} does not suit the model's {kvh} KV heads (neither divides the other)",
            f"use a TP that divides {kvh} or a multiple of {kvh} that divides {heads}",
        )


def _checkpoint_quantization(c: _Facts) -> None:
    """The spec's quantization matches the checkpoint's quantization_config."""
    assert c.facts is not None
    quant = c.r["model"].get("quantization")
    ck = c.facts.get("quant")
    if quant in ("awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors") and not ck:
        c.add(
            "model.quantization",
            f"`{quant}` needs a checkpoint quantized that way, but {c.how} has no quantization_config",
            "serve an AWQ/GPTQ checkpoint (e.g. Qwen/Qwen2.5-7B-Instruct-AWQ), or use `quantization: fp8` to quantize "
            "a 16-bit checkpoint on load",
        )
    elif quant and ck and ck.get("method") in _COMPATIBLE and quant not in _COMPATIBLE[ck["method"]]:
        c.add(
            "model.quantization",
            f"the checkpoint is {ck['method']}-quantized; vLLM refuses `quantization: {quant}` for it",
            f"use one of: {', '.join(sorted(_COMPATIBLE[ck['method']]))} (or leave it unset to use the checkpoint's)",
        )


def _context(c: _Facts) -> None:
    """An explicit max_model_len fits the model's context (a profile's is capped by :func:`apply_model_facts`)."""
    assert c.facts is not None
    m = c.r["model"]
    ctx = c.facts.get("context")
    if ctx and m["max_model_len"] > ctx and not m.get("max_model_len_from_profile"):
        c.add(
            "model.max_model_len",
            f"{m['max_model_len']} is beyond the model's context of {ctx} tokens (max_position_embeddings)",
            f"use at most {ctx}",
        )


def _speculative(c: _Facts) -> None:
    """Speculative decoding on a small single-GPU model measured no gain."""
    if speculative_small(c.r, c.facts):
        assert c.facts is not None
        c.add(
            "engine.speculative",
            f"speculative decoding on one GPU with a ~{planner.total_params(c.facts) / 1e9:.0f}B model: the 000 "
            "article measured no gain (TTFT p99 x25 at concurrency 16)",
            "remove `speculative:` unless a benchmark on this GPU shows a gain",
            "warning",
        )


def _memory_plan(c: _Facts) -> None:
    """The memory plan: weights, overhead and one full sequence of KV cache fit the GPU (or the replica's share of
    it)."""
    if c.g is None or c.cpu or any(p.path == "parallel.tensor" and p.severity == "error" for p in c.out):
        return
    m, e, g = c.r["model"], c.r["engine"], c.g
    p = planner.plan(c.r, facts=(c.facts, c.how))  # the facts hardware_problems read
    if p["fits"]:
        return
    path = (
        "model.quantization"
        if (p.get("quantization") is None and p["weights_gib"] > 0.5 * p["budget_gib"])
        else "engine.gpu_memory_utilization"
    )
    need = p["weights_gib"] + p["overhead_gib"] + m["max_model_len"] * p["kv_bytes_per_token"] / 2**30
    fit_n = max(1, int(p["memory_gib"] * e["gpu_memory_utilization"] // need))
    split = f" / replicas.per_gpu {p['replicas_per_gpu']}" if p.get("replicas_per_gpu", 1) > 1 else ""
    c.add(
        "replicas.per_gpu"
        if split and p["weights_gib"] + p["overhead_gib"] < p["budget_gib"] * p["replicas_per_gpu"]
        else path,
        f"does not fit on {g['name']}: {p['memory_gib']} GiB x {e['gpu_memory_utilization']}{split} = "
        f"{p['budget_gib']} GiB per {'replica' if split else 'GPU'}; weights {p['weights_gib']} GiB + overhead "
        f"{p['overhead_gib']} GiB leave {max(0.0, p['kv_cache_gib'])} GiB of KV cache = {p['kv_tokens']} tokens, "
        f"below one sequence of max_model_len {m['max_model_len']} ({p['kv_bytes_per_token']} bytes per token per GPU)",
        (
            f"lower replicas.per_gpu to at most {fit_n} (each needs about {need:.1f} GiB for one full sequence) or "
            "shrink each replica: "
            if split
            else "free memory "
        )
        + OOM_FIX_ORDER
        + "; see `vllm-fleet plan SPEC`",
    )


#: The rules that need the GPU only, then those that need the model's facts, in the order their problems are reported.
GPU_RULES = (_gpu, _gpu_count, _flashinfer, _precision, _activation_dtype)
MODEL_RULES = (_heads, _checkpoint_quantization, _context, _speculative, _memory_plan)


def hardware_problems(resolved: dict[str, Any], spec: Spec | None = None) -> list[Problem]:
    """Every problem of ``resolved`` against the model and GPU catalogues: the GPU's rules, then
    (with the model's facts) the model's; without facts, what could not be checked."""
    c = _Facts(resolved, spec)
    for rule in GPU_RULES:
        rule(c)
    c.facts, c.how = catalog.facts_for(resolved)
    if c.facts is None:
        _without_model_facts(c)
        return c.out
    for rule in MODEL_RULES:
        rule(c)
    return c.out


def flashinfer_problems(resolved: dict[str, Any], cc: float | None, spec: Spec | None = None) -> list[Problem]:
    """Warnings where FlashInfer would need what an offline host will not have: a given
    ``install.wheelhouse`` with flashinfer-python but not its ``flashinfer-cubin`` (FlashInfer
    would download its pre-built kernels at first use), and a feature that JIT-compiles FlashInfer
    kernels (nvcc at first use) with ``install.wheelhouse`` (an offline host: no apt for a CUDA
    toolkit there either)."""
    from vllm_fleet.specs import flashinfer, localpath

    out: list[Problem] = []
    ins = resolved["install"]
    wh = ins.get("wheelhouse")
    line = (lambda path: spec.line(path)) if spec else (lambda path: None)
    # a wheelhouse that cannot be read here is the install.wheelhouse problem of spec.localpath;
    # this optional look inside it is then skipped
    here = localpath.readable(wh, "dir")[0] if wh else None
    if here is not None:
        lacking = flashinfer.wheelhouse_lacks_cubin(here)
        if lacking:
            out.append(
                Problem(
                    "install.wheelhouse",
                    f"{wh} has {flashinfer.PYTHON} {lacking} but not {flashinfer.CUBIN} {lacking}: vLLM >= 0.26 no "
                    "longer requires it, and without it FlashInfer downloads its pre-built kernels at first use, "
                    "which a host without internet cannot",
                    f"add it to the wheelhouse: pip download --no-deps --only-binary=:all: -d {wh} "
                    f"{flashinfer.CUBIN}=={lacking} (the same version as flashinfer-python, exactly)",
                    "warning",
                    line("install.wheelhouse"),
                )
            )
    why = flashinfer.jit_features(resolved, cc)
    if why and wh:
        out.append(
            Problem(
                "install.wheelhouse",
                f"{'; '.join(why)}: vLLM then JIT-compiles FlashInfer kernels at first use, with nvcc, and this "
                "host installs from a wheelhouse (offline: the nvidia role cannot fetch a CUDA toolkit either)",
                "have a CUDA toolkit on the host (nvcc; the nvidia role installs cuda-toolkit-X-Y unless "
                f"nvidia_install_toolkit: false) or put {flashinfer.JIT_CACHE} of the same version and CUDA (from "
                "FlashInfer's own wheel index) into the wheelhouse",
                "warning",
                line("install.wheelhouse"),
            )
        )
    return out


def speculative_small(resolved: dict[str, Any], facts: dict[str, Any] | None) -> bool:
    par = resolved["parallel"]
    if not resolved["engine"].get("speculative") or par["tensor"] * par["pipeline"] != 1:
        return False
    return facts is None or planner.total_params(facts) / 1e9 <= SMALL_MODEL_B
