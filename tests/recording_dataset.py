"""A ``_target_`` dataset for the CLI tests under torchrun: RandomClassification that appends
every index it serves to ``$RECORD_DIR/rank<RANK>.txt`` (nothing without ``RECORD_DIR``), so a
test can check which samples each rank trained."""

from __future__ import annotations

import os

import torch

from autobatch.workloads.batches import RandomClassification


class RecordingDataset(RandomClassification):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        directory = os.environ.get("RECORD_DIR")
        if directory:
            with open(os.path.join(directory, f"rank{os.environ.get('RANK', '0')}.txt"), "a", encoding="utf-8") as log:
                log.write(f"{index}\n")
        return super().__getitem__(index)
