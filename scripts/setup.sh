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
    # Linux's CPU wheels carry a +cpu label, asked for by name: a plain ==2.13.0 would take a
    # +cu128 wheel in find-links (that label sorts higher) or PyPI's CUDA build; macOS has no label
    spec="torch==2.13.0"; [ "$(uname -s)" = Linux ] && spec="torch==2.13.0+cpu"
    local_wheel=$(mktemp -d)
    if "$PYTHON" -m pip download --quiet --no-index --no-deps "$spec" -d "$local_wheel" 2>/dev/null; then
        # a local CPU wheel in pip's find-links (no download); torch's own dependencies come
        # from the index as usual
        "$PYTHON" -m pip install --quiet "$local_wheel"/torch-*.whl
    else
        "$PYTHON" -m pip install --quiet "$spec" --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple
    fi
    rm -rf "$local_wheel"
fi
# an older torch would be replaced by pip's resolver with PyPI's torch (a CUDA build on Linux)
if ! "$PYTHON" -c "import sys, torch; v = torch.__version__.split('+')[0].split('.'); sys.exit((int(v[0]), int(v[1])) < (2, 9))"; then
    echo "setup: autobatch needs torch>=2.9 and this Python has torch $("$PYTHON" -c 'import torch; print(torch.__version__)');" \
         "upgrade it first (CPU: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu), then rerun" >&2
    exit 1
fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".${extras}"
