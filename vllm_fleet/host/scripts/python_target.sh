# python_target.sh: what the host's wheels must fit (the PythonTarget fact of the vllm role):
# `machine=`, `glibc=` and, when the host has a python3, `python=X.Y`. Reads only.
echo machine=$(uname -m)
echo glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2)
command -v python3 >/dev/null && python3 -c 'import sys; print("python=%d.%d" % sys.version_info[:2])' || true
