"""Estimated vs measured peak memory of real training steps; prints a markdown table.

On CUDA the measurement is ``torch.cuda.max_memory_allocated`` over two real steps (the second
sees Adam's moments), with the model and optimizer resident, against
``estimate_memory(...).peak_bytes``. With ``--device cpu`` the measurement is the peak of
:func:`autobatch.simulated_memory` over the same two steps, against the estimate's step peak
(the simulation does not count the resident model), so the script can be checked anywhere.

    python scripts/estimate_accuracy.py                      # CUDA if available
    python scripts/estimate_accuracy.py --device cpu         # small models, simulated peaks
    python scripts/estimate_accuracy.py --batch-sizes 8,32,128 --json accuracy.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autobatch  # noqa: E402
from autobatch.planning.checkpointing import enable_checkpointing  # noqa: E402
from autobatch.probe.tracing.estimate import estimate_memory  # noqa: E402


# -- models ---------------------------------------------------------------------------------
class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def make_cnn(channels: int, blocks: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Sequential(*[ConvBlock(channels) for _ in range(blocks)]),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 100),
    )


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attention = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_step(kind: str, device: str, small: bool, autocast_dtype, checkpointing: bool) -> autobatch.TrainStep:
    torch.manual_seed(0)
    if kind == "cnn":
        channels, blocks, side = (16, 2, 16) if small else (64, 4, 64)
        model = make_cnn(channels, blocks).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def make_batch(size):
            return (torch.randn(size, 3, side, side, device=device), torch.randint(0, 100, (size,), device=device))

        def loss_fn(model, batch):
            return nn.functional.cross_entropy(model(batch[0]), batch[1])
    else:
        vocab, width, layers, heads, seq = (256, 64, 2, 4, 32) if small else (8192, 512, 6, 8, 256)
        model = GPT(vocab, width, layers, heads, seq).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def make_batch(size):
            tokens = torch.randint(0, vocab, (size, seq + 1), device=device)
            return tokens[:, :-1], tokens[:, 1:]

        def loss_fn(model, batch):
            return nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())

    if checkpointing:
        enable_checkpointing(model)
    return autobatch.TrainStep(model, optimizer, loss_fn, make_batch, autocast_dtype=autocast_dtype)


# -- measurement ----------------------------------------------------------------------------
def measure(step: autobatch.TrainStep, batch_size: int, device: str, steps: int) -> tuple[int, int]:
    """(peak, memory allocated before the steps)."""
    if device == "cpu":
        with autobatch.simulated_memory("64GiB") as simulation:
            for _ in range(steps):
                step(batch_size)
            return simulation.peak_bytes, 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(steps):
        step(batch_size)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), before


def warm_up(device: str) -> None:
    """Create cuBLAS/cuDNN handles (and their workspaces) before the first row, so every row
    measures the same way; what they hold is in every measured peak, as in a real probe."""
    if device == "cpu":
        return
    for small in (make_step("cnn", device, True, None, False), make_step("gpt", device, True, torch.bfloat16, False)):
        small(2)
    del small
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 8,32 on the CPU, 16,64,256 on CUDA)")
    parser.add_argument("--models", default="cnn,gpt")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="small models (default on the CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    device = args.device
    small = args.small or device == "cpu"
    sizes = [int(s) for s in (args.batch_sizes or ("8,32" if device == "cpu" else "16,64,256")).split(",")]
    precisions = {"fp32": None, "bf16": torch.bfloat16}

    if device == "cpu":
        where = f"CPU (measured: autobatch.simulated_memory peak), torch {torch.__version__}"
    else:
        where = f"{torch.cuda.get_device_name(0)} (measured: torch.cuda.max_memory_allocated), torch {torch.__version__}"
    print(f"Estimated vs measured peak memory of {args.steps} training steps on {where}\n")
    print("| model | precision | checkpointing | batch | estimated | measured | error | estimate time |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    warm_up(device)
    for kind in args.models.split(","):
        for precision, dtype in precisions.items():
            for checkpointing in (False, True):
                for batch_size in sizes:
                    step = make_step(kind, device, small, dtype, checkpointing)
                    began = time.perf_counter()
                    estimate = estimate_memory(step, batch_size, steps=args.steps)
                    seconds = time.perf_counter() - began
                    estimated = estimate.step_peak_bytes if device == "cpu" else estimate.peak_bytes
                    try:
                        measured, before = measure(step, batch_size, device, args.steps)
                    except torch.OutOfMemoryError:
                        measured, before = None, None
                    error = None if not measured else (estimated - measured) / measured * 100
                    rows.append(dict(model=kind, precision=precision, checkpointing=checkpointing, batch_size=batch_size,
                                     estimated=estimated, measured=measured, error_pct=error, estimate_s=seconds,
                                     resident_estimated=estimate.resident_bytes, allocated_before=before))
                    print(
                        f"| {kind} | {precision} | {'yes' if checkpointing else 'no'} | {batch_size} | "
                        f"{autobatch.format_bytes(estimated)} | "
                        f"{autobatch.format_bytes(measured) if measured else 'OOM'} | "
                        f"{'-' if error is None else f'{error:+.1f} %'} | {seconds:.2f} s |",
                        flush=True,
                    )
                    del step, estimate
                    gc.collect()
                    if device != "cpu":
                        torch.cuda.empty_cache()
    errors = [abs(row["error_pct"]) for row in rows if row["error_pct"] is not None]
    if errors:
        print(f"\nlargest error {max(errors):.1f} %, mean {sum(errors) / len(errors):.1f} % over {len(errors)} rows")
    if args.json:
        args.json.write_text(json.dumps({"device": where, "rows": rows}, indent=1))
    return 0 if errors and max(errors) <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
