#!/usr/bin/env bash
# Every single-GPU figure of the README's "Benchmarks on a GPU" section, in two device calls
# that each fit a 10-minute limit. Writes logs and tables to $OUT (default /tmp/autobatch_bench).
#
#   bash scripts/gpu_bench.sh probe    # GPU tests, probe auto vs Accelerate, estimate accuracy
#   python scripts/bench_probe.py      # every method once, Lightning's too (a device call of its own)
#   bash scripts/gpu_bench.sh train    # runner overhead and recovery, planner throughput pick
#
# On the lent GPU machine, carry wheels for hydra-core/omegaconf/antlr4/tenacity in .whl/; they
# are installed to /tmp/site first (the image lacks them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/autobatch_bench}
mkdir -p "$OUT"
if ! python3 -c "import hydra, omegaconf, tenacity" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
status=0
run() {  # run NAME COMMAND...: log to $OUT/NAME.log, show its tail, remember a failure
    local name=$1; shift
    echo "== $name: $*"
    local began=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1 || { echo "   $name exited $?"; status=1; }
    tail -${TAIL:-40} "$OUT/$name.log"
    echo "   ($((SECONDS - began)) s)"
}
case "${1:-probe}" in
  probe)
    run gpu_tests python3 -m pytest -m gpu -q -rs tests
    run bench_probe python3 scripts/bench_probe.py --memory-limit 16GiB --repeat ${REPEAT:-5} \
        --methods autobatch-auto accelerate --out "$OUT/bench_probe.md"
    run accuracy python3 scripts/estimate_accuracy.py --json "$OUT/accuracy.json"
    ;;
  train)
    run runner python3 scripts/bench_runner.py --device cuda --json "$OUT/runner.json"
    run plan python3 scripts/bench_plan.py --device cuda
    ;;
  *) echo "usage: $0 probe|train"; exit 2 ;;
esac
exit $status
