#!/usr/bin/env bash
# The distributed checks of tests/distributed/test_distributed.py with NCCL on real GPUs, via torchrun.
#
#   NPROC=2 scripts/gpu_distributed.sh            # on a machine with >= 2 GPUs
#   SCENARIOS= NPROC=2 scripts/gpu_distributed.sh # the CLI steps only
#   SKIP_HF=1 NPROC=2 scripts/gpu_distributed.sh  # without the transformers DDP check (minutes)
#
# Each scenario of tests/distributed_worker.py runs under `torchrun --nproc-per-node $NPROC`
# with BACKEND=nccl (every rank on GPU LOCAL_RANK), then scripts/check_distributed.py checks
# the reports: the probe's batch is the smallest over per-rank caps (PROBE_LIMITS, applied
# with set_per_process_memory_fraction), an OOM injected on rank 1 only in each phase is
# recovered by every rank with identical weights equal to the uninjected run, a non-OOM error
# stops every rank, and a skipped or mismatched sync point is a RankDisagreementError.
# Finally the CLI runs under torchrun: the probe (rank 0 writes result.json), then train with
# each rank on its share of the global batch and an OOM injected on rank 1 (it finishes, rank 0
# alone writes one metrics.jsonl with a line per step of the whole global batch, both ranks
# recovered); and a Ctrl-C to torchrun's process group after 3 training steps stops every rank
# after the same step with the checkpoint written. Where transformers is installed, a Trainer's
# fit_batch_size over the processes must train in the DDP train() wraps the model in
# (scripts/gpu_hf_ddp.py). A DDP BatchNorm model that rank 0 evaluates alone between runner steps
# must run no collective there (scripts/gpu_ddp_eval.py). Every step has a timeout, so a hang fails.
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
export BACKEND=${BACKEND:-nccl} OMP_NUM_THREADS=1 PYTHONPATH="$PWD$SITE${PYTHONPATH:+:$PYTHONPATH}" PROBE_LIMITS=${PROBE_LIMITS:-2GiB,1GiB} PROBE_MAX=${PROBE_MAX:-65536}
nvidia-smi --query-gpu=index,name,memory.total --format=csv || true
status=0
SCENARIOS=${SCENARIOS-probe faults peer_error skipped_sync mismatched}
for scenario in $SCENARIOS; do
  echo "== $scenario"
  port=$((29500 + RANDOM % 2000))
  if ! timeout 300 python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$port" \
      tests/distributed_worker.py "$scenario" "$OUT/$scenario" > "$OUT/$scenario.log" 2>&1; then
    echo "   $scenario: torchrun failed or timed out (log: $OUT/$scenario.log)"; tail -20 "$OUT/$scenario.log"; status=1
  fi
done
if [ -n "$SCENARIOS" ]; then python scripts/check_distributed.py "$OUT" "$NPROC" || status=1; fi
echo "== CLI: torchrun -m autobatch probe device=${DEVICE:-cuda}"
if timeout 300 python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((31500 + RANDOM % 2000)) \
    -m autobatch probe "device=${DEVICE:-cuda}" model=mlp probe.strategy=binary probe.memory_limit=512MiB \
    "hydra.run.dir=$OUT/cli" > "$OUT/cli.log" 2>&1; then
  grep -h "agreed over" "$OUT/cli/result.json" || { echo "   CLI: no agreement note"; status=1; }
else
  echo "   CLI failed or timed out"; tail -20 "$OUT/cli.log"; status=1
fi
STEPS=6 GLOBAL=$((64 * NPROC))
echo "== CLI: torchrun -m autobatch train device=${DEVICE:-cuda} (global batch $GLOBAL, OOM injected on rank 1)"
if timeout 300 python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((33500 + RANDOM % 2000)) \
    -m autobatch train "device=${DEVICE:-cuda}" model=mlp "train.global_batch=$GLOBAL" train.micro_batch=32 \
    "train.steps=$STEPS" train.grow_after=0 "train.inject_oom=[[2,backward]]" "train.inject_oom_ranks=[1]" \
    "hydra.run.dir=$OUT/cli_train" > "$OUT/cli_train.log" 2>&1; then
  python - "$OUT/cli_train" "$STEPS" "$GLOBAL" "$NPROC" <<'PY' || status=1
import json, pathlib, sys
run, steps, global_batch, world = pathlib.Path(sys.argv[1]), *map(int, sys.argv[2:])
failures = 0
def check(name, ok, detail=""):
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} CLI train: {name} {detail}")
found = sorted(str(p.relative_to(run)) for p in run.rglob("metrics.jsonl"))
check("one metrics.jsonl", found == ["metrics.jsonl"], found)
lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if found else []
check("a line per step", [m["step"] for m in lines] == list(range(1, steps + 1)), len(lines))
check("global samples per step", all(m["samples"] == global_batch and m["ranks"] == world for m in lines))
summary = json.loads((run / "train_result.json").read_text())
recoveries = [(r["step"], r["phase"], r["micro_batch"]) for r in summary["oom_recoveries"]]
check("rank 0 replayed rank 1's OOM", recoveries == [(2, "backward", 16)], recoveries)
check("files of rank 0 only", sorted(p.name for p in run.iterdir()) == sorted([".hydra", "checkpoints", "final_model.pt", "metrics.jsonl", "train.log", "train_result.json"]))
sys.exit(1 if failures else 0)
PY
  grep -q "\[rank 1\].*OOM at step 2 in backward" "$OUT/cli_train.log" || { echo "   CLI train: rank 1 logged no recovery"; status=1; }
else
  echo "   CLI train failed or timed out"; tail -20 "$OUT/cli_train.log"; status=1
fi
echo "== CLI: Ctrl-C to torchrun -m autobatch train device=${DEVICE:-cuda} after 3 steps: every rank stops after the same step, saved"
setsid python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((35500 + RANDOM % 2000)) \
    -m autobatch train "device=${DEVICE:-cuda}" model=mlp "train.global_batch=$GLOBAL" train.micro_batch=32 \
    train.steps=200 train.inject_delay=0.2 "hydra.run.dir=$OUT/cli_stop" > "$OUT/cli_stop.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  [ -f "$OUT/cli_stop/metrics.jsonl" ] && [ "$(wc -l < "$OUT/cli_stop/metrics.jsonl")" -ge 3 ] && break; sleep 0.1
done
kill -INT -- "-$launcher" 2>/dev/null || true  # the whole process group, as a terminal's Ctrl-C
timeout 120 tail --pid="$launcher" -f /dev/null || { echo "   CLI stop: the ranks did not end"; kill -KILL -- "-$launcher"; status=1; }
python - "$OUT/cli_stop" "$OUT/cli_stop.log" <<'PY' || status=1
import json, pathlib, re, sys, torch
run, log = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).read_text()
said = re.findall(r"interrupted \(SIGINT\) at step (\d+) on every rank; checkpoint", log)
step = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["step"]
lines = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
ok = said == [str(step)] and lines == list(range(1, step + 1)) and 3 <= step < 200
print(f"{'ok  ' if ok else 'FAIL'} CLI stop: one line {said}, checkpoint step {step}, metrics 1..{lines[-1] if lines else None}")
sys.exit(0 if ok else 1)
PY
echo "== DDP with BatchNorm: rank 0 evaluates alone between steps and after fit; SyncBatchNorm warned (scripts/gpu_ddp_eval.py)"
if timeout 180 python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((39500 + RANDOM % 2000)) \
    scripts/gpu_ddp_eval.py $([ "${DEVICE:-cuda}" = cuda ] || echo --quick) > "$OUT/ddp_eval.log" 2>&1; then
  grep -h "ddp eval on rank 0 alone" "$OUT/ddp_eval.log"
else
  echo "   DDP eval failed or timed out"; tail -20 "$OUT/ddp_eval.log"; status=1
fi
if [ -z "${SKIP_HF:-}" ] && python -c "import transformers" 2>/dev/null && [ "${DEVICE:-cuda}" = cuda ]; then
  echo "== transformers: fit_batch_size over $NPROC processes, then train() in the DDP it wraps (scripts/gpu_hf_ddp.py)"
  if timeout 480 python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port $((37500 + RANDOM % 2000)) \
      scripts/gpu_hf_ddp.py --memory-limit "${HF_LIMIT:-12GiB}" --out "$OUT/hf_ddp.json" > "$OUT/hf_ddp.log" 2>&1; then
    python - "$OUT/hf_ddp.json" <<'PY' || status=1
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
shipped, unwrapped, *above = rows
ok = not shipped["any_rank_oom"] and shipped["wrapped"] == "DistributedDataParallel"
print(f"{'ok  ' if ok else 'FAIL'} transformers DDP: answer {shipped['answer']} trained {shipped['steps_trained']} steps "
      f"(stand-in {shipped['bucket_bytes'] / 2**20:.0f} MiB, peak {shipped.get('peak_mib')} MiB); without a stand-in "
      f"{unwrapped['answer']}; " + ", ".join(f"{row['batch']}: {'out of memory' if row['any_rank_oom'] else 'trained'}"
                                                for row in above))
sys.exit(0 if ok else 1)
PY
  else
    echo "   transformers DDP failed or timed out"; tail -20 "$OUT/hf_ddp.log"; status=1
  fi
fi
echo "== done: status $status (reports under $OUT)"
exit $status
