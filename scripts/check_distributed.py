"""Check the reports that ``scripts/gpu_distributed.sh`` collected (one folder per scenario).

Prints one line per check and exits 1 if any failed. The same checks as
``tests/distributed/test_distributed.py``, minus the single-process comparisons the GPU run cannot make.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

PHASES = ("transfer", "forward", "backward", "optimizer")


def main(out: Path, world: int) -> int:
    failures = 0

    def check(name: str, ok: bool, detail: object = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")

    def reports(scenario: str) -> list[dict] | None:
        try:
            found = [json.loads((out / scenario / f"rank{r}.json").read_text()) for r in range(world)]
        except OSError as exc:
            check(f"{scenario}: every rank reported", False, exc)
            return None
        crashed = [r for r, report in enumerate(found) if "crash" in report]
        check(f"{scenario}: no rank crashed", not crashed, [found[r]["crash"][-500:] for r in crashed])
        return None if crashed else found

    if (probe := reports("probe")) is not None:
        for strategy in ("binary", "auto"):
            sizes = [report[strategy]["batch_size"] for report in probe]
            check(f"probe {strategy}: every rank got the same batch", len(set(sizes)) == 1, sizes)
            check(f"probe {strategy}: lockstep trials", len({tuple(r[strategy]["trials"]) for r in probe}) == 1)
    if (faults := reports("faults")) is not None:
        base = [torch.load(out / "faults" / report["none"]["weights"]) for report in faults]
        check("faults: uninjected ranks equal", all(torch.equal(a, b) for w in base[1:] for a, b in zip(base[0], w)))
        for phase in PHASES:
            runs = [report[phase] for report in faults]
            got = [torch.load(out / "faults" / run["weights"]) for run in runs]
            same = all(torch.equal(a, b) for w in got[1:] for a, b in zip(got[0], w))
            close = all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(got[0], base[0]))
            after = 4 if phase == "optimizer" else 2  # no micro-batch sizes the optimizer step: replayed at the same
            recovered = all([(x["step"], x["phase"], x["micro_batch"]) for x in run["recoveries"]] == [(1, phase, after)] for run in runs)
            check(f"faults {phase}: every rank recovered at step 1 with micro-batch {after}", recovered)
            check(f"faults {phase}: ranks identical, equal to the uninjected run", same and close)
    if (peer := reports("peer_error")) is not None:
        check("peer_error: rank 1 ValueError, others PeerFailedError",
              peer[1]["error"] == "ValueError" and all(r["error"] == "PeerFailedError" for i, r in enumerate(peer) if i != 1))
    if (skipped := reports("skipped_sync")) is not None:
        check("skipped_sync: rank 0 RankDisagreementError", skipped[0]["error"] == "RankDisagreementError", skipped[0].get("message", ""))
    if (mismatched := reports("mismatched")) is not None:
        check("mismatched: every rank RankDisagreementError", all(r["error"] == "RankDisagreementError" for r in mismatched))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2))
