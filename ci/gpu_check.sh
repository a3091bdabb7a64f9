#!/usr/bin/env bash
# The GPU kit: run zero-core's GPU checks (ci/gpu/check.py) on a machine with a CUDA GPU.
#
#   bash ci/gpu_check.sh                    # report in gpu_check_out/gpu_check.{json,md}
#   bash ci/gpu_check.sh --out /tmp/kit     # other flags go to ci/gpu/check.py (-k, --quick, ...)
#
# Needs no network: it uses the Python in $PYTHON (default python3), which must already hold
# a CUDA build of torch, triton, numpy, pluggy and safetensors; it does not use
# ci/setup_env.sh (that installs the CPU build of torch). zero-core is installed for this run
# only, into a temporary directory put on PYTHONPATH (pip --no-index --no-deps
# --no-build-isolation --target; if pip cannot build it, a link farm with the same
# package layout and the same entry point). Nothing is installed into $PYTHON's environment.
#
# Time: about 5 minutes on one H100 before the multi-rank checks (ranks/, last; estimated 2-3
# minutes more, not yet run on a GPU); GPU_CHECK_BUDGET (default 540) is the wall-clock limit
# in seconds for the whole run, installation included: checks still pending when it is spent
# are skipped and reported as such.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
start=$SECONDS
say() { echo "[gpu_check.sh] $*" >&2; }

if ! command -v "$py" >/dev/null 2>&1; then
    say "FAILED: '$py' not found; set PYTHON to a Python with a CUDA build of torch"
    exit 2
fi

# ---- 1. a CUDA GPU seen by a CUDA build of torch ---------------------------------------------
"$py" - <<'EOF' || exit 2
import sys
try:
    import torch
except Exception as exc:  # noqa: BLE001
    sys.exit(f"[gpu_check.sh] FAILED: {sys.executable} cannot import torch ({exc}); set PYTHON "
             f"to a Python whose environment has a CUDA build of torch")
if torch.version.cuda is None:
    sys.exit(f"[gpu_check.sh] FAILED: torch {torch.__version__} in {sys.executable} was built "
             f"without CUDA; set PYTHON to a Python with a CUDA build of torch")
if not torch.cuda.is_available():
    sys.exit(f"[gpu_check.sh] FAILED: torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
             f"no GPU: torch.cuda.is_available() is False. Check nvidia-smi and "
             f"CUDA_VISIBLE_DEVICES; without a GPU, `python ci/gpu/check.py --device cpu --quick` "
             f"dry-runs the kit")
print(f"[gpu_check.sh] {torch.cuda.get_device_name(0)}; torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}); {sys.executable}", file=sys.stderr)
EOF

# ---- 2. zero-core importable, offline, for this run only -------------------------------------
tmp="$(mktemp -d "${TMPDIR:-/tmp}/zero_core_gpu_kit.XXXXXX")" || { say "FAILED: mktemp"; exit 2; }
trap 'rm -rf "$tmp"' EXIT
site="$tmp/site"

install_with_pip() {
    # build from a copy of the sources, so that the checkout gets no build/ or egg-info
    local src="$tmp/src"
    mkdir -p "$src/tests" || return 1
    cp -R "$repo/pyproject.toml" "$repo/setup.py" "$repo/README.md" "$repo/zero_core" \
        "$repo/backends" "$repo/accel_kernels" "$src/" || return 1
    cp -R "$repo/tests/conformance" "$src/tests/" || return 1
    find "$src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} + 2>/dev/null
    find "$src" \( -name '*.so' -o -name '*.pyd' \) -delete 2>/dev/null
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$py" -m pip install --no-deps \
        --no-build-isolation --no-index --quiet --target "$site" "$src" >"$tmp/pip.log" 2>&1
}

install_link_farm() {
    # the package layout of pyproject.toml ([tool.setuptools.package-dir]) as symbolic
    # links, and a dist-info that declares the built-in plugin's entry point
    rm -rf "$site" && mkdir -p "$site/zero_core" || return 1
    local entry
    for entry in "$repo"/zero_core/*; do
        [ "$(basename "$entry")" = "__pycache__" ] || ln -s "$entry" "$site/zero_core/" || return 1
    done
    ln -s "$repo/backends" "$site/zero_core/backends" &&
    ln -s "$repo/accel_kernels" "$site/zero_core/accel_kernels" &&
    ln -s "$repo/tests/conformance" "$site/zero_core/conformance" || return 1
    local version
    version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)"
    local info="$site/zero_core-${version:-0}.dist-info"
    mkdir -p "$info" &&
    printf 'Metadata-Version: 2.1\nName: zero-core\nVersion: %s\n' "${version:-0}" >"$info/METADATA" &&
    printf '[zero_core]\nbuiltin = zero_core.backends.plugin\n' >"$info/entry_points.txt" &&
    : >"$info/RECORD"
}

if install_with_pip; then
    say "zero-core installed for this run into $site (pip, offline)"
else
    say "pip could not build zero-core offline (last lines of its log below); using a link farm"
    tail -n 5 "$tmp/pip.log" >&2
    install_link_farm || { say "FAILED: could not make zero-core importable"; exit 2; }
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# from $tmp, not the checkout: `python -c` puts the working directory first on sys.path, and
# the checkout's ./zero_core (which has no backends/ inside) would shadow the installed package
(cd "$tmp" && "$py" -c "
import zero_core, zero_core.backends, zero_core.accel_kernels, zero_core.conformance
from zero_core.runtime import registry
reg = registry.load()
assert 'cuda' in reg.accelerators and 'nccl' in reg.communicators, (sorted(reg.accelerators), sorted(reg.communicators))
print('[gpu_check.sh] zero-core', zero_core.__version__, 'from', zero_core.__file__)
") >&2 || { say "FAILED: zero-core does not import from $site (see above)"; exit 2; }

# ---- 3. the checks -------------------------------------------------------------------------------
budget=$(( ${GPU_CHECK_BUDGET:-540} - (SECONDS - start) - 20 ))
[ "$budget" -lt 60 ] && budget=60
cd "$repo" || exit 2
"$py" ci/gpu/check.py --device cuda --budget "$budget" "$@"
