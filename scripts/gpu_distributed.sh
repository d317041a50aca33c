#!/usr/bin/env bash
# The distributed checks of tests/test_distributed.py with NCCL on real GPUs, via torchrun.
#
#   NPROC=2 scripts/gpu_distributed.sh            # on a machine with >= 2 GPUs
#
# Each scenario of tests/distributed_worker.py runs under `torchrun --nproc-per-node $NPROC`
# with BACKEND=nccl (every rank on GPU LOCAL_RANK), then scripts/check_distributed.py checks
# the reports: the probe's batch is the smallest over per-rank caps (PROBE_LIMITS, applied
# with set_per_process_memory_fraction), an OOM injected on rank 1 only in each phase is
# recovered by every rank with identical weights equal to the uninjected run, a non-OOM error
# stops every rank, and a skipped or mismatched sync point is a RankDisagreementError.
# Finally the CLI probe runs under torchrun. Every step has a timeout, so a hang fails.
# The runner needs tenacity and the CLI hydra-core/omegaconf: with a .whl folder of wheels
# (see /work/shared/FIELD_NOTES.md), they are installed from it first.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
OUT=${OUT:-/tmp/autobatch_gpu_distributed}
rm -rf "$OUT" && mkdir -p "$OUT"
SITE=""
if ! python -c "import tenacity, hydra, omegaconf" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  SITE=":/tmp/site"
fi
# per-rank caps: on CUDA a step needs tens of MiB at batch 1 (cuBLAS workspace, context-side
# buffers), so the GPU defaults are larger than the CPU test's budgets
export BACKEND=${BACKEND:-nccl} OMP_NUM_THREADS=1 PYTHONPATH="$PWD$SITE" PROBE_LIMITS=${PROBE_LIMITS:-2GiB,1GiB} PROBE_MAX=${PROBE_MAX:-65536}
nvidia-smi --query-gpu=index,name,memory.total --format=csv || true
status=0
for scenario in probe faults peer_error skipped_sync mismatched; do
  echo "== $scenario"
  port=$((29500 + RANDOM % 2000))
  if ! timeout 300 python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$port" \
      tests/distributed_worker.py "$scenario" "$OUT/$scenario" > "$OUT/$scenario.log" 2>&1; then
    echo "   $scenario: torchrun failed or timed out (log: $OUT/$scenario.log)"; tail -20 "$OUT/$scenario.log"; status=1
  fi
done
python scripts/check_distributed.py "$OUT" "$NPROC" || status=1
echo "== CLI: torchrun -m autobatch probe device=${DEVICE:-cuda}"
if timeout 300 python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((31500 + RANDOM % 2000)) \
    -m autobatch probe "device=${DEVICE:-cuda}" model=mlp probe.strategy=binary probe.memory_limit=512MiB \
    "hydra.run.dir=$OUT/cli" > "$OUT/cli.log" 2>&1; then
  grep -h "agreed over" "$OUT/cli/result.json" || { echo "   CLI: no agreement note"; status=1; }
else
  echo "   CLI failed or timed out"; tail -20 "$OUT/cli.log"; status=1
fi
echo "== done: status $status (reports under $OUT)"
exit $status
