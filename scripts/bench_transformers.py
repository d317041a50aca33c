"""Side by side: ``fit_batch_size`` against ``TrainingArguments(auto_find_batch_size=True)``.

For each model, in one process, under the same per-process memory cap, each method on a fresh
``transformers.Trainer`` (same seed, same data) that then trains ``--steps`` optimizer steps:

* **autobatch** ``fit_batch_size(trainer)`` then ``trainer.train()``: the probe's wall time,
  the per-device batch it set, and whether ``train()`` ran every step (an out-of-memory error
  there is reported, not retried);
* **Transformers** ``auto_find_batch_size=True`` starting at ``per_device_train_batch_size=G``
  (the batch a user wants): Accelerate's decorator around the training loop, which restarts it
  at x0.9 after each out-of-memory error. Its search time is the time from ``train()`` until
  the start of the attempt that finished (every restart in between, with the steps each ran
  before its OOM); it never changes ``gradient_accumulation_steps``, so its global batch is
  the size it ended at (transformers#33281);
* **autobatch with the global batch**: ``fit_batch_size(trainer, global_batch=G)``, which sets
  the micro-batch and the accumulation so every optimizer step trains G samples;
* the **exact maximum**: the largest per-device batch at which a fresh trainer's ``train()``
  (accumulation 1) runs ``--exact-steps`` steps in this process, stepping up from autobatch's
  answer (+1, +2, +4, ...) until one runs out of memory, then bisecting.

Workloads: GPT-2 small (``GPT2LMHeadModel``, 124 M parameters, packed samples of 1024 tokens,
labels = inputs) and ViT-B/16 (``ViTForImageClassification``,
224 x 224); both built from configs, no download; bf16 on CUDA. ``--quick --device cpu``: tiny
configs under autobatch's simulated memory cap (seconds; proves the script runs).

    python scripts/bench_transformers.py --device cuda --memory-limit 12GiB --out transformers.json
    python scripts/bench_transformers.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autobatch  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402
from autobatch.memory.units import parse_bytes  # noqa: E402

import transformers  # noqa: E402


class PadCollator:
    """Pads token samples to the batch's longest; labels are the inputs (padding ignored)."""

    def __call__(self, samples):
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        mask = torch.zeros(len(samples), width, dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, : len(sample["input_ids"])] = torch.as_tensor(sample["input_ids"])
            mask[row, : len(sample["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def workload(name: str, quick: bool):
    """(model factory, training set, collator, global batch)."""
    generator = torch.Generator().manual_seed(0)
    if name == "gpt2":
        config = (transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=2) if quick
                  else transformers.GPT2Config())
        # packed sequences of the full context, as in pretraining: every batch is the longest
        data = [{"input_ids": torch.randint(0, config.vocab_size, (config.n_positions,), generator=generator)}
                for _ in range(2048)]
        return (lambda: transformers.GPT2LMHeadModel(config)), data, PadCollator(), 64
    if name == "vit":
        config = (transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128, num_labels=10) if quick
                  else transformers.ViTConfig(num_labels=10))
        size = config.image_size
        data = [{"pixel_values": torch.randn(3, size, size, generator=generator), "labels": i % 10} for i in range(1024)]
        return (lambda: transformers.ViTForImageClassification(config)), data, transformers.default_data_collator, 512
    raise ValueError(f"unknown workload {name!r}: gpt2 or vit")


class Watch(transformers.TrainerCallback):
    """When each attempt of the training loop began, at which per-device batch, and its steps."""

    def __init__(self) -> None:
        self.attempts: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        loader = kwargs.get("train_dataloader")
        size = getattr(loader, "total_batch_size", None) or getattr(loader, "batch_size", None)
        self.attempts.append({"start": time.perf_counter(), "batch_size": size, "steps": 0})

    def on_step_end(self, args, state, control, **kwargs):
        self.attempts[-1]["steps"] += 1


def make_trainer(spec, device: str, out: str, steps: int, quick: bool, **arguments):
    factory, data, collator, _ = spec
    torch.manual_seed(0)
    model = factory()
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_drop_last=True, use_cpu=device == "cpu", bf16=device != "cpu" and not quick,
        learning_rate=1e-4, **arguments)
    watch = Watch()
    return transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                                callbacks=[watch]), watch


def release(*trainers) -> None:
    for trainer in trainers:
        trainer.model = trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None
    gc.collect()
    autobatch.free_memory()


def train(trainer) -> dict:
    """``trainer.train()``: steps run, and the out-of-memory error that stopped it (None: none)."""
    try:
        trainer.train()
        return {"oom": None}
    except Exception as error:  # noqa: BLE001 - only an OOM is a result; anything else propagates
        if not autobatch.is_oom_error(error):
            raise
        return {"oom": str(error).splitlines()[0][:160]}


def run_autobatch(spec, args, global_batch: int | None) -> dict:
    trainer, watch = make_trainer(spec, args.device, args.tmp, args.steps, args.quick, per_device_train_batch_size=1)
    start = time.perf_counter()
    result = fit_batch_size(trainer, global_batch=global_batch, cache=False)  # the cap is capped()'s
    seconds = time.perf_counter() - start
    size, accumulation = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
    trained = train(trainer)
    row = {"probe_seconds": round(seconds, 2), "probe_answer": result.batch_size, "per_device": size,
           "accumulation": accumulation, "global_batch": size * accumulation, "trials": len(result.trials),
           "steps_trained": sum(a["steps"] for a in watch.attempts), **trained}
    release(trainer)
    return row


def run_transformers(spec, args) -> dict:
    global_batch = spec[3]
    trainer, watch = make_trainer(spec, args.device, args.tmp, args.steps, args.quick,
                                  per_device_train_batch_size=global_batch, auto_find_batch_size=True)
    start = time.perf_counter()
    trained = train(trainer)
    total = time.perf_counter() - start
    final = watch.attempts[-1] if watch.attempts else {"start": start, "batch_size": None, "steps": 0}
    row = {"search_seconds": round(final["start"] - start, 2), "total_seconds": round(total, 2),
           "per_device": final["batch_size"], "accumulation": trainer.args.gradient_accumulation_steps,
           "global_batch": (final["batch_size"] or 0) * trainer.args.gradient_accumulation_steps,
           "attempts": [a["batch_size"] for a in watch.attempts], "steps_trained": final["steps"], **trained}
    release(trainer)
    return row


def trains(spec, args, size: int, cap) -> bool:
    """Whether a fresh trainer at per-device ``size`` runs ``--exact-steps`` steps under the cap."""
    with capped(args.device, cap):  # the model made under it: on the CPU its parameters count too
        trainer, watch = make_trainer(spec, args.device, args.tmp, args.exact_steps, args.quick,
                                      per_device_train_batch_size=size)
        ok = train(trainer)["oom"] is None
        release(trainer)
    return ok


def exact_maximum(spec, args, start: int, cap) -> int:
    """Step up from ``start`` (+1, +2, +4, ...) until a size fails, then bisect."""
    lo, hi, stride = start, None, 1
    if not trains(spec, args, lo, cap):  # the answer itself failed here: search down instead
        hi, lo = lo, 0
    while hi is None:
        guess = lo + stride
        if guess > len(spec[1]):
            return lo
        if trains(spec, args, guess, cap):
            lo, stride = guess, stride * 2
        else:
            hi = guess
    while hi - lo > 1:
        middle = (lo + hi) // 2
        lo, hi = (middle, hi) if trains(spec, args, middle, cap) else (lo, middle)
    return lo


@contextlib.contextmanager
def capped(device: str, cap):
    """The cap: a per-process memory fraction on CUDA, autobatch's simulated device on the CPU."""
    if device == "cpu":
        with autobatch.simulated_memory(cap):
            yield
        return
    torch.cuda.set_per_process_memory_fraction(parse_bytes(cap) / torch.cuda.get_device_properties(0).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--memory-limit", default=None, help="per-process cap (default 12GiB on CUDA, 24MiB on the CPU)")
    parser.add_argument("--workloads", default="gpt2,vit")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps each trainer then trains")
    parser.add_argument("--exact-steps", type=int, default=10, help="steps a size must run to count as training")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact maximum")
    parser.add_argument("--quick", action="store_true", help="tiny configs (CPU smoke run)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device (use --device cpu --quick)")
    cap = args.memory_limit or ("24MiB" if args.device == "cpu" else "12GiB")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    env = {"device": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "memory_limit": cap, "steps": args.steps}
    print(json.dumps(env))
    rows = []
    with tempfile.TemporaryDirectory() as args.tmp:
        for name in args.workloads.split(","):
            spec = workload(name, args.quick)
            warm, _ = make_trainer(spec, args.device, args.tmp, 2, args.quick, per_device_train_batch_size=1)
            train(warm)  # untimed: the process's first steps (kernel loading) are nobody's probe
            release(warm)
            with capped(args.device, cap):
                ours = run_autobatch(spec, args, None)
                theirs = run_transformers(spec, args)
                kept = run_autobatch(spec, args, spec[3])
            row = {"workload": name, "wanted_global_batch": spec[3], "autobatch": ours, "transformers": theirs,
                   "autobatch_global": kept}
            if not args.no_exact:
                row["exact"] = exact_maximum(spec, args, ours["probe_answer"], cap)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"env": env, "rows": rows}, handle, indent=1)


def print_table(rows) -> None:
    print("\n| workload (exact max) | method | per-device batch | of exact | global batch (wanted) | "
          "search s | trained |")
    print("| --- | --- | ---: | ---: | --- | ---: | --- |")
    for row in rows:
        exact = row.get("exact")
        for method, key, seconds in (("autobatch `fit_batch_size`", "autobatch", "probe_seconds"),
                                     ("Transformers `auto_find_batch_size`", "transformers", "search_seconds"),
                                     ("autobatch `fit_batch_size(global_batch=G)`", "autobatch_global", "probe_seconds")):
            r = row[key]
            share = f"{r['per_device'] / exact:.3f}" if exact and r["per_device"] else "-"
            trained = f"{r['steps_trained']} steps" + (f", OOM: {r['oom'][:60]}" if r["oom"] else "")
            if key == "autobatch_global":
                share = f"({r['per_device']} x {r['accumulation']})"
            print(f"| {row['workload']} ({exact}) | {method} | {r['per_device']} | {share} | "
                  f"{r['global_batch']} ({row['wanted_global_batch']}) | {r[seconds]} | {trained} |")


if __name__ == "__main__":
    main()
