#!/usr/bin/env bash
# The test command: sets up the environment, then runs the whole test suite.
#   bash ci/test.sh            # everything
#   bash ci/test.sh -k engine  # extra arguments go to pytest
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/ci/setup_env.sh" || { echo "environment setup failed" >&2; exit 1; }
cd "$repo"
export ZERO_CORE_REQUIRE_NATIVE=1  # CI proves the built C quantization library runs (tests/test_quant_native.py)
python -m zero_core.cli report --check || { echo "zero-core report failed" >&2; exit 1; }
# the engine's device tests run on the vdev device (examples/vdev), which must have built
python -c "import zero_core_vdev" || { echo "examples/vdev is not installed: the device tests need it (see ci/setup_env.sh)" >&2; exit 1; }
python -m pytest -q -ra --durations=15 "$@"
status=$?
if [ $status -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit $status
