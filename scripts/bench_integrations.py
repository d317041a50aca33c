"""Side by side: autobatch's integrations against the finders users have today.

For each model, in one process, under the same memory cap:

* the exact maximum: ``autobatch.find_max_batch(strategy="binary")`` on a ``TrainStep`` (full
  trials of forward, backward and Adam step): the reference every answer is a fraction of;
* Lightning: ``BatchSizeFinder(mode="power")`` and ``(mode="binsearch")`` against
  ``autobatch.integrations.lightning.AutoBatchSize``, each inside ``Trainer.fit`` (time from fit
  start until the size is set; then that same fit trains ``--fit-steps`` steps at the answer (50
  on the GPU): whether it ran them all or ran out of memory is reported; AutoBatchSize's
  confirmation in Lightning's loop is printed under the table);
* the decorator: ``accelerate.utils.find_executable_batch_size`` against
  ``autobatch.find_executable_batch_size``, each starting at 4× the exact maximum and running
  3 training steps per attempt.

Prints a markdown table (answer, fraction of the exact maximum, wall seconds, attempts, whether
training at the answer ran) and writes JSON with ``--json``.

    python scripts/bench_integrations.py --device cuda --memory-limit 16GiB   # ResNet-50 + GPT (GPU)
    python scripts/bench_integrations.py --device cpu --quick                  # seconds, simulated budget
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
import warnings
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autobatch  # noqa: E402
from autobatch.memory.units import format_bytes, parse_bytes  # noqa: E402
from autobatch.workloads.models import GPT, MLP  # noqa: E402


# -- workloads ------------------------------------------------------------------------------------
def workloads(device: str, quick: bool) -> dict:
    """name -> (model factory, sample factory(n) -> (inputs, targets), loss(model, x, y))."""
    def classify(model, x, y):
        return F.cross_entropy(model(x), y)

    def lm(model, x, y):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    if quick:
        return {
            "mlp": (lambda: MLP((64,), 10, width=256), lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,))), classify),
            "gpt-tiny": (lambda: GPT(128, 32, layers=2, width=64, heads=4),
                         lambda n: (torch.randint(0, 128, (n, 32)), torch.randint(0, 128, (n, 32))), lm),
        }
    import torchvision

    return {
        "resnet50": (lambda: torchvision.models.resnet50(), lambda n: (torch.randn(n, 3, 224, 224), torch.randint(0, 1000, (n,))), classify),
        "gpt-small": (lambda: GPT(50257, 512, layers=12, width=768, heads=12),
                      lambda n: (torch.randint(0, 50257, (n, 512)), torch.randint(0, 50257, (n, 512))), lm),
    }


def fresh(factory, device):
    torch.manual_seed(0)
    model = factory().to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def cleanup():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the reference ---------------------------------------------------------------------------------
def exact_max(spec, device, limit):
    factory, sample, loss = spec
    model, optimizer = fresh(factory, device)

    def make_batch(n):
        x, y = sample(n)
        return x.to(device), y.to(device)

    step = autobatch.TrainStep(model, optimizer, lambda m, b: loss(m, *b), make_batch)
    began = time.perf_counter()
    result = autobatch.find_max_batch(step, strategy="binary", search_steps=None, cache=False)
    return result.batch_size, time.perf_counter() - began


# -- Lightning ------------------------------------------------------------------------------------
def lightning_rows(spec, device, exact, quick, fit_steps, capped):
    """Each finder inside ``Trainer.fit``, then ``fit_steps`` training steps of that same fit at
    its answer: the size, the seconds until it was set, whether fit trained them all (or its OOM)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder

    from autobatch.integrations.lightning import AutoBatchSize

    factory, sample, loss = spec

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            torch.manual_seed(0)
            self.model = factory()
            x, y = sample(max(8, 4 * exact))
            self.data = torch.utils.data.TensorDataset(x, y)

        def training_step(self, batch, index):
            value = loss(self.model, *batch)
            self.log("loss", value)
            return value

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)

    class Clock(pl.Callback):
        def on_train_start(self, trainer, module):
            self.found_at, self.size, self.steps = time.perf_counter(), module.batch_size, 0

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            self.steps += 1

    rows = []
    finders = {
        "lightning BatchSizeFinder(power)": lambda: BatchSizeFinder(mode="power", max_trials=25),
        "lightning BatchSizeFinder(binsearch)": lambda: BatchSizeFinder(mode="binsearch", max_trials=25),
        "autobatch AutoBatchSize": lambda: AutoBatchSize(),
    }
    for name, make in finders.items():
        cleanup()
        clock, finder = Clock(), make()
        accelerator = "cpu" if device == "cpu" else "gpu"
        trainer = pl.Trainer(accelerator=accelerator, devices=1, max_steps=fit_steps, max_epochs=-1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[finder, clock], default_root_dir=os.environ.get("TMPDIR", "/tmp"))
        began, trained, error, module = time.perf_counter(), True, None, None
        try:
            with capped():
                module = Module()
                trainer.fit(module)
        except Exception as exc:  # noqa: BLE001 - a finder whose answer OOMs in fit is a result
            trained, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        found = getattr(clock, "size", getattr(module, "batch_size", None))
        seconds = getattr(clock, "found_at", time.perf_counter()) - began
        steps = getattr(clock, "steps", 0)
        result = row(name, found, exact, seconds, None, trained and steps == fit_steps, error, steps=steps)
        confirmation = getattr(finder, "confirmation", None)
        if confirmation is not None:
            result["probe"] = finder.result.batch_size
            result["confirmation"] = confirmation.summary()
        rows.append(result)
        del trainer, module, finder
    return rows


# -- the decorators -------------------------------------------------------------------------------
def decorator_rows(spec, device, exact, capped):
    from accelerate.utils import find_executable_batch_size as accelerate_decorator

    factory, sample, loss = spec
    rows = []
    for name, decorate in (("accelerate find_executable_batch_size", accelerate_decorator),
                           ("autobatch find_executable_batch_size", autobatch.find_executable_batch_size)):
        cleanup()
        model = optimizer = None
        attempts = []

        @decorate(starting_batch_size=4 * exact)
        def train(batch_size):
            attempts.append(batch_size)
            for _ in range(3):
                x, y = sample(batch_size)
                optimizer.zero_grad(set_to_none=True)
                loss(model, x.to(device), y.to(device)).backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return batch_size

        began, trained, error, found = time.perf_counter(), True, None, None
        try:
            with capped():  # the model is made inside the budget, as in exact_max
                model, optimizer = fresh(factory, device)
                found = train()
        except Exception as exc:  # noqa: BLE001
            trained, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row(name, found, exact, time.perf_counter() - began, len(attempts), trained, error))
        del model, optimizer, train
    return rows


def row(method, found, exact, seconds, attempts, trained, error, steps=None):
    return {"method": method, "batch": found, "fraction": None if not found else round(found / exact, 3),
            "seconds": round(seconds, 2), "attempts": attempts, "trained": trained, "error": error, "steps": steps}


# -- main -----------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models (the CPU smoke test)")
    parser.add_argument("--memory-limit", default=None, help="cap (CUDA: per-process fraction; CPU: simulated budget)")
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--skip", default="", help="comma-separated: lightning, decorator")
    parser.add_argument("--fit-steps", type=int, default=None,
                        help="training steps fit runs at each Lightning finder's answer (default: 50; quick: 4)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    limit = args.memory_limit or ("24MiB" if args.device == "cpu" else None)
    specs = workloads(args.device, args.quick or args.device == "cpu")
    if args.models:
        specs = {k: v for k, v in specs.items() if k in args.models.split(",")}
    # on the CPU each measurement gets a budget of its own: what an earlier row left alive (a
    # finder's failed fit) is not counted against the next one, as a fresh process would not be
    capped = (lambda: autobatch.simulated_memory(limit)) if args.device == "cpu" else nullcontext
    if args.device != "cpu" and limit is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(parse_bytes(limit) / total)
    device_name = "cpu (simulated)" if args.device == "cpu" else torch.cuda.get_device_name(0)
    report = {"device": device_name, "memory_limit": limit, "torch": torch.__version__, "models": {}}
    skip = set(args.skip.split(",")) - {""}
    fit_steps = args.fit_steps or (4 if args.quick or args.device == "cpu" else 50)
    for name, spec in specs.items():
        with capped():
            exact, exact_s = exact_max(spec, args.device, limit)
        rows = [row("exact maximum (find_max_batch binary, full trials)", exact, exact, exact_s, None, True, None)]
        cleanup()
        if "lightning" not in skip:
            rows += lightning_rows(spec, args.device, exact, args.quick, fit_steps, capped)
        if "decorator" not in skip:
            rows += decorator_rows(spec, args.device, exact, capped)
        report["models"][name] = rows
        print(f"\n### {name} on {device_name}, cap {limit or 'none'}\n")
        print("| method | batch | of exact max | seconds | attempts | trained at it |")
        print("|---|---:|---:|---:|---:|---|")
        for r in rows:
            trained = "yes" if r["trained"] else f"no ({r['error']})"
            if r["steps"] is not None:
                trained = f"{trained}, fit ran {r['steps']}/{fit_steps} steps"
            print(f"| {r['method']} | {r['batch']} | {r['fraction']} | {r['seconds']} | {r['attempts'] or ''} | {trained} |")
        for r in rows:
            if r.get("confirmation"):
                print(f"\n{r['method']}: probe {r['probe']}; {r['confirmation']}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
