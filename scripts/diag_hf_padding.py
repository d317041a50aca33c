"""``fit_batch_size`` on a padded training set, on a GPU: does the answer train when the run's
batches are padded? (Review 33: the probe built its batches from the longest sample alone, never
padded, so the attention mask was all ones, which a BERT drops, while the run's padded batches
build a batch x heads x length x length mask.)

A BERT-base from its config, its base frozen and its classifier head trained (as a user fine-tunes
a head), on samples of two lengths (16 and 512 tokens, shuffled), ``DataCollatorWithPadding``.
Probed twice under one cap: as ``fit_batch_size`` probes by default (the set's shortest sample
padded beside its longest), and with ``sample=`` the longest alone (what the probe built before);
then ``trainer.train()`` for ``--steps`` steps at each answer under the same cap, in this process.

    python scripts/diag_hf_padding.py --memory-limit 8GiB
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformers  # noqa: E402

from autobatch.integrations.transformers import fit_batch_size  # noqa: E402
from autobatch.memory.units import parse_bytes  # noqa: E402


class Tokenizer:
    """What ``DataCollatorWithPadding`` needs of a tokenizer: ``pad``, to the longest in the batch."""

    pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

    def pad(self, features, return_tensors="pt", **_):
        longest = max(len(f["input_ids"]) for f in features)
        return {key: torch.tensor([f[key] + [0] * (longest - len(f[key])) for f in features])
                for key in ("input_ids", "attention_mask")} | {"labels": torch.tensor([f["labels"] for f in features])}


def trainer_for(rows, steps: int, out: str) -> transformers.Trainer:
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig()).requires_grad_(False)
    model.classifier.requires_grad_(True)
    args = transformers.TrainingArguments(output_dir=out, report_to=[], max_steps=steps, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=rows,
                                data_collator=transformers.DataCollatorWithPadding(Tokenizer()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--steps", type=int, default=30)
    options = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    lengths = [512 if torch.rand((), generator=generator) < 0.5 else 16 for _ in range(20000)]
    rows = [{"input_ids": [7] * n, "attention_mask": [1] * n, "labels": int(n > 100)} for n in lengths]
    limit = parse_bytes(options.memory_limit)
    total = torch.cuda.get_device_properties(0).total_memory
    for label, sample in (("padded (default)", None), ("longest alone (before)", "longest")):
        with tempfile.TemporaryDirectory() as out:
            trainer = trainer_for(rows, options.steps, out)
            longest = max(rows, key=lambda row: len(row["input_ids"]))
            result = fit_batch_size(trainer, memory_limit=limit, cache=False,
                                    **({"sample": longest} if sample else {}))
            size = trainer.args.per_device_train_batch_size
            torch.cuda.set_per_process_memory_fraction(limit / total)
            torch.cuda.reset_peak_memory_stats()
            try:
                trainer.train()
                outcome = f"trained {options.steps} steps, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
            except torch.OutOfMemoryError as exc:
                outcome = f"out of memory at step {trainer.state.global_step + 1}: {str(exc).splitlines()[0][:120]}"
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)
            print(f"{label}: answer {result.batch_size} ({size} set) in {result.elapsed_s:.2f} s; train(): {outcome}", flush=True)
            del trainer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
