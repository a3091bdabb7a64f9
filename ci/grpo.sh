#!/usr/bin/env bash
# GRPO post-training of the demo GPT at ZeRO stage 3 on 2 local CPU ranks under mpirun
# (examples/grpo_gpt.py; docs/usage.md, "Post-training: GRPO at stage 3").
#
#   bash ci/grpo.sh                              # stage 3, fp32, ~2 minutes on 2 idle cores
#   bash ci/grpo.sh --precision bf16 --stage 2   # any examples/grpo_gpt.py flag passes through
#
# ZERO_CORE_DEMO_RANKS changes the number of ranks (default 2).
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_local.sh" examples/grpo_gpt.py "$@"
