#!/usr/bin/env bash
# GRPO post-training of the demo GPT at ZeRO stage 3 on 2 local CPU ranks under mpirun
# (examples/grpo_gpt.py; README "Post-training: GRPO at stage 3").
#
#   bash ci/grpo.sh                              # stage 3, fp32, ~2 minutes on 2 idle cores
#   bash ci/grpo.sh --precision bf16 --stage 2   # any examples/grpo_gpt.py flag passes through
#
# ZERO_CORE_DEMO_RANKS changes the number of ranks (default 2).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# shellcheck disable=SC1091
source ci/setup_env.sh

# Open MPI refuses to run as root unless told that this is intended
if [ "$(id -u)" = "0" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

ranks="${ZERO_CORE_DEMO_RANKS:-2}"
mpirun_bin="$(dirname "$(command -v python)")/mpirun"
[ -x "$mpirun_bin" ] || mpirun_bin="$(command -v mpirun || true)"
if [ -z "$mpirun_bin" ]; then
    echo "grpo: mpirun not found; install MPI support with: pip install 'zero-core[mpi]'" >&2
    exit 1
fi

# --oversubscribe: more ranks than cores is allowed; PYTHONUNBUFFERED: progress as it happens
exec "$mpirun_bin" -np "$ranks" --oversubscribe -x PYTHONUNBUFFERED=1 \
    python examples/grpo_gpt.py "$@"
