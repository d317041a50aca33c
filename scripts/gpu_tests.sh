#!/usr/bin/env bash
# Run every GPU test (pytest marker `gpu`) in one go; they skip without CUDA.
# On the lent GPU machine, carry wheels for hydra-core/omegaconf/antlr4/tenacity in .whl/ and
# they are installed to /tmp/site first (the image lacks them).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import hydra, omegaconf, tenacity" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# -p no:benchmark: the GPU image has pytest-benchmark, whose fixture name clashes with a test argument
python3 -m pytest -p no:benchmark -m gpu -v -rs tests "$@"
