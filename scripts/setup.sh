#!/usr/bin/env bash
# Install autobatch into the current Python environment (editable), with `--dev` the test tools too.
#
# torch comes first and only when it is missing: a machine that already has a CUDA build keeps it.
# Without torch we install the CPU build of torch 2.13.0 -- from a local wheel where pip's
# find-links has one (no download), else from PyTorch's CPU index -- never PyPI's multi-GB
# CUDA build by accident.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup: torch not found; installing the CPU build of torch==2.13.0" >&2
    local_wheel=$(mktemp -d)
    if "$PYTHON" -m pip download --quiet --no-index --no-deps "torch==2.13.0" -d "$local_wheel" 2>/dev/null; then
        # a local CPU wheel in pip's find-links: pip takes it (its +cpu label sorts first);
        # torch's own dependencies come from the index as usual
        "$PYTHON" -m pip install --quiet "$local_wheel"/torch-*.whl
    else
        "$PYTHON" -m pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple
    fi
    rm -rf "$local_wheel"
fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".${extras}"
