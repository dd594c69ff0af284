# flashinfer_cubin.sh: after vLLM's install (CUDA), FlashInfer's pre-built kernels at exactly the
# env's FlashInfer version (the vllm role; vllm_fleet.specs.flashinfer says why). Run as root:
#     sh -c "$(cat flashinfer_cubin.sh)" flashinfer-cubin PY PYTHON_DIST CUBIN_DIST SOURCE PIP_INSTALL...
# PY: the env's Python; PYTHON_DIST, CUBIN_DIST: the two distributions' names; SOURCE: where pip
# looks (for the warning); PIP_INSTALL...: the pip install command line, the requirement appended.
# No PYTHON_DIST in the env: nothing. The source lacking that version: a warning on stderr, status 0.
py=$1 dist=$2 cubin=$3 source=$4
shift 4
v=$("$py" -c 'import sys, importlib.metadata as m; print(m.version(sys.argv[1]))' "$dist" 2>/dev/null) && [ -n "$v" ] || exit 0
"$@" "$cubin==$v" || echo "vllm role: WARNING: $cubin==$v (FlashInfer's pre-built kernels, the version of $dist) is not in $source: FlashInfer downloads them at first use, which a host without internet cannot" >&2
