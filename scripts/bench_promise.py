"""Is the probed answer a promise? (issue 16) Answer vs exact maximum, 200 steps at the answer in
the probing process and in a fresh one, probe time vs Accelerate's find_executable_batch_size.

For each workload (ViT-B/16, ResNet-50 with cudnn.benchmark=True, ResNet-50 without, GPT-2-like,
a Llama-style decoder; tiny stand-ins with ``--quick``), side by side in one process:

0. a warm-up: two untimed steps of a throwaway copy, so no timed probe pays the process's warm-up;
1. ``TrainStep`` form: ``find_max_batch(TrainStep(...))`` timed, then ``Runner`` trains ``--steps``
   steps at the answer in the same process under the same cap (any OOM recovery = broken promise);
2. plain-callable form (what Accelerate users bring): ``find_max_batch(step_fn)`` timed, then a
   plain loop of ``--steps`` calls at the answer, same process, same cap;
3. the exact maximum: from the answer, step up (+1, +2, +4, ...) until a 3-step run OOMs, bisect;
4. Accelerate's ``find_executable_batch_size`` from the power of two above the exact maximum
   (3 steps per attempt), timed (skipped when accelerate is not installed);
5. a fresh process per form trains ``--steps`` steps at that form's answer (``--child``; ``--fresh-runs``
   new processes each, since a size at the allocator's wall passes some runs and fails others);
   With ``--exact-fresh``, also the largest size whose plain loop trains ``--steps`` steps in a new
   process, stepping by one from the smaller answer (the 3-step figure is a size that ran 3 steps
   in the probing process; whether it trains is the new process's question); with ``--resumed``
   the size must also train in a new process whose optimizer state exists before its first step,
   as after loading a checkpoint (``plain_resumed``: made by one step on zero gradients), where
   the state sits apart from the first step's activations instead of among them, and each form's
   answer trains in a resumed new process as well (``runner_resumed``, ``plain_resumed``);
6. with ``--cli`` (GPT-2, ResNet-50 and ViT workloads, spelled as the library forms): ``python -m autobatch probe`` then ``train`` in
   a new process (a cache hit), reading train_result.json's recoveries (``train`` runs within the same
   cap); ``--cli-same`` adds ``train`` probing for itself (``probe.cache=false``), ``--cli-bound`` a
   ``train`` at the smallest size above the answer's 0.99 reach (a recovery there bounds the exact
   maximum). ``--cli-only --workloads default --memory-limit none`` runs the README's first command on
   the whole device, then ``train``.
7. ``--timing-only``: just the exact maximum and the three probes' wall times (TrainStep, plain,
   Accelerate), each in its own fresh process after the same warm-up, ``--rounds`` rounds with
   the order rotated: the speed comparison, free of the order bias of a shared process.

Run on the GPU (the lead, one H200; full mode < 9 min at the default 8 GiB cap):
    python scripts/bench_promise.py --out promise.json
    python scripts/bench_promise.py --quick --device cpu        (seconds; proves it runs)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autobatch  # noqa: E402
from autobatch import free_memory, is_oom_error  # noqa: E402
from autobatch.memory.simulated import active_simulation, host_memory  # noqa: E402
from autobatch.workloads.models import GPT, MLP, ResNetCNN  # noqa: E402
from promise_families import FAMILIES  # noqa: E402  (beside this script)

COMPILE = False  # --compile (set in main)
WORKLOADS = ("vit_b16", "resnet50_tuned", "resnet50", "gpt2", "llama")
# beside them, models the probe was not tuned on (``--workloads`` picks them): depthwise
# convolutions with SiLU and cuDNN autotuning, LayerNorm and 7x7 depthwise kernels, a bidirectional
# encoder with a padding mask and a masked-language-model loss, an encoder-decoder (T5-small: dict
# batches, two sequence lengths) and a cuDNN LSTM language model (RNN workspaces)
MORE_WORKLOADS = ("efficientnet_b0_tuned", "convnext_tiny", "bert", "t5", "lstm", "lm128k")
# ... and any other torchvision classifier by its name (``--workloads densenet121,swin_t``): these
# prefixes route to ``torchvision.models.<name>(num_classes=10)`` at 224x224
# ... and the families in promise_families.py (FAMILIES: deeplabv3, r3d18, mixtral, vae, fasterrcnn, unet,
# lora_llama, wav2vec2, clip, whisper, segformer; and promise_families_next.py's maskrcnn, vitmae, ssm)
TORCHVISION_PREFIXES = ("efficientnet", "convnext", "densenet", "swin", "mobilenet", "regnet", "resnext",
                        "wide_resnet", "shufflenet", "maxvit", "vgg")
LLAMA = dict(vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,  # a Llama-style decoder
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024)


# -- workloads ------------------------------------------------------------------------------------
def build(name: str, device: str, quick: bool):
    """``(model, optimizer, loss_fn, make_batch, autocast dtype, cudnn.benchmark)``."""
    torch.manual_seed(0)
    bench = name.endswith("_tuned")
    dtype = torch.bfloat16 if device == "cuda" else None
    base = name.removesuffix("_tuned")  # the built-in ViT-B/16 and ResNet-50 by these names only (vit_b_32, resnet101: torchvision's)
    if base == "vit_b16":
        model, shape = _vit(quick), (3, 32, 32) if quick else (3, 224, 224)
    elif base == "resnet50":
        model, shape = _resnet(quick), (3, 16, 16) if quick else (3, 224, 224)
    elif base.startswith(TORCHVISION_PREFIXES) or _is_torchvision(base):
        model, shape = _torchvision(name.removesuffix("_tuned"), quick), (3, 32, 32) if quick else (3, 224, 224)
    elif name == "bert" and _importable("transformers"):
        return _bert(device, quick) + (dtype, bench)
    elif name == "t5" and _importable("transformers"):
        return _t5(device, quick) + (dtype, bench)
    elif name == "lstm":
        return _lstm(device, quick) + (dtype, bench)
    elif base in FAMILIES:  # scripts/promise_families.py: segmentation, video, MoE, VAE, detection, U-Net, LoRA, speech
        return FAMILIES[base](device, quick) + (dtype, bench)
    elif name == "lm128k":
        return _lm128k(device, quick) + (dtype, bench)
    else:
        model, shape = _decoder(name, quick), None
    model = model.to(device)
    if COMPILE:  # --compile: every form trains the torch.compile'd model (one wrapper per build)
        model = torch.compile(model, dynamic=True if COMPILE == "dynamic" else None)
    if shape is None:
        return _next_token(model, *((64, 16) if quick else (50257, 1024)), device) + (dtype, bench)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make(b):  # an image classifier's batch
        return torch.randn(b, *shape, device=device), torch.randint(0, 10, (b,), device=device)

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch[0]).float(), batch[1])
    return model, optimizer, loss_fn, make, dtype, bench


def _vit(quick: bool):
    try:
        from torchvision.models import VisionTransformer, vit_b_16
    except ImportError:
        return MLP((3, 32, 32), 10, width=64)  # stand-in where torchvision is missing (CPU quick runs)
    if quick:
        return VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10)
    return vit_b_16(num_classes=10)


def _resnet(quick: bool):
    try:
        from torchvision.models import resnet18, resnet50
    except ImportError:
        return ResNetCNN(3, 10, width=8, stages=2)
    return resnet18(num_classes=10) if quick else resnet50(num_classes=10)


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _is_torchvision(name: str) -> bool:
    """Whether ``name`` is a torchvision classifier builder (``resnet101``, ``vit_b_32``)."""
    try:
        import torchvision.models as models
    except ImportError:
        return False
    return name in models.list_models(module=models)


def _torchvision(name: str, quick: bool):
    try:
        import torchvision.models as models
    except ImportError:
        return ResNetCNN(3, 10, width=8, stages=2)
    return models.resnet18(num_classes=10) if quick else getattr(models, name)(num_classes=10)


def _bert(device: str, quick: bool):
    """BERT-base as a masked-language model: 512-token sequences with a padding mask (a random
    length each), 15 % of the tokens predicted. ``(model, optimizer, loss_fn, make)``."""
    seq, vocab = (16, 64) if quick else (512, 30522)
    from transformers import BertConfig, BertForMaskedLM

    config = (BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=seq) if quick else BertConfig(vocab_size=vocab))
    model = BertForMaskedLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make(b):
        ids = torch.randint(0, vocab, (b, seq), device=device)
        lengths = torch.randint(seq // 2, seq + 1, (b, 1), device=device)
        mask = (torch.arange(seq, device=device) < lengths).long()
        labels = torch.where((torch.rand(b, seq, device=device) < 0.15) & mask.bool(), ids, -100)
        return ids, mask, labels

    def loss_fn(m, batch):
        ids, mask, labels = batch
        logits = m(input_ids=ids, attention_mask=mask).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
    return model, optimizer, loss_fn, make


def _t5(device: str, quick: bool):
    """T5-small as a sequence-to-sequence model: 512 source tokens with a padding mask, 128 target
    tokens, a dict batch as a Transformers user writes it. ``(model, optimizer, loss_fn, make)``."""
    from transformers import T5Config, T5ForConditionalGeneration

    src, tgt, vocab = (16, 8, 64) if quick else (512, 128, 32128)
    ids = dict(pad_token_id=0, decoder_start_token_id=0, eos_token_id=1)
    config = (T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, **ids) if quick else
              T5Config(vocab_size=vocab, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, **ids))
    model = T5ForConditionalGeneration(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make(b):
        lengths = torch.randint(src // 2, src + 1, (b, 1), device=device)
        return {"input_ids": torch.randint(0, vocab, (b, src), device=device),
                "attention_mask": (torch.arange(src, device=device) < lengths).long(),
                "labels": torch.randint(0, vocab, (b, tgt), device=device)}

    def loss_fn(m, batch):
        return m(**batch).loss
    return model, optimizer, loss_fn, make


def _lstm(device: str, quick: bool):
    """A 2-layer LSTM language model (cuDNN's RNN kernels and workspaces): 256 tokens of a 32k
    vocabulary, hidden size 1024. ``(model, optimizer, loss_fn, make)``."""
    seq, vocab, width = (16, 64, 32) if quick else (256, 32000, 1024)

    class LSTMLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.rnn = torch.nn.LSTM(width, width, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, tokens):
            return self.head(self.rnn(self.embed(tokens))[0])

    return _next_token(LSTMLM().to(device), vocab, seq, device)


def _lm128k(device: str, quick: bool):
    """A small decoder with a Llama-3-sized vocabulary (128,256 tokens; 4 layers, width 512, 128
    tokens): its loss's float logits are the step's largest request, about a fifth of an 8 GiB
    cap at its answer. ``(model, optimizer, loss_fn, make)``."""
    seq, vocab = (16, 64) if quick else (128, 128256)
    model = (GPT(vocab_size=vocab, max_seq_len=seq, layers=1, width=16, heads=2) if quick else
             GPT(vocab_size=vocab, max_seq_len=seq, layers=4, width=512, heads=8))
    return _next_token(model.to(device), vocab, seq, device)


def _next_token(model, vocab: int, seq: int, device: str):
    """``(model, optimizer, loss_fn, make)`` of a language model trained on ``seq`` random tokens of
    ``vocab`` to predict the next one, its loss over float logits (a Hugging Face model's
    ``.logits`` too), as language-model training code computes it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make(b):
        return torch.randint(0, vocab, (b, seq + 1), device=device)

    def loss_fn(m, tokens):
        out = m(tokens[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    return model, optimizer, loss_fn, make


def _to_host(batch):
    """A batch (a tensor, or tuples, lists and dicts of them: a detector's images and targets) in host memory."""
    if isinstance(batch, dict):
        return {key: _to_host(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_host(t) for t in batch)
    return batch.cpu() if isinstance(batch, torch.Tensor) else batch


def _decoder(name: str, quick: bool):
    if name not in ("gpt2", "llama"):  # a misspelt name was silently GPT-2 ("resnet101" before this check)
        raise SystemExit(f"unknown workload {name!r}: one of "
                         f"{', '.join(WORKLOADS + MORE_WORKLOADS + tuple(FAMILIES))}, or a "
                         "torchvision classifier's name")
    if name == "llama" and not quick:
        try:
            from transformers import LlamaConfig, LlamaForCausalLM

            return LlamaForCausalLM(LlamaConfig(**LLAMA))
        except ImportError:
            pass
    if quick:
        return GPT(vocab_size=64, max_seq_len=16, layers=1, width=16, heads=2)
    return GPT(vocab_size=50257, max_seq_len=1024, layers=12, width=768, heads=12)  # GPT-2 small shape


# -- the forms ------------------------------------------------------------------------------------
def plain_step(model, optimizer, loss_fn, make, dtype, device):
    """An Accelerate user's step function: forward, backward, step, zero_grad."""

    def step(batch_size: int) -> None:
        batch = make(batch_size)
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


class Capped:
    """Cap the process (CUDA: per-process fraction; CPU: a simulated budget) for training."""

    def __init__(self, device: str, limit: int) -> None:
        self.device, self.limit, self.sim = device, limit, None

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.set_per_process_memory_fraction(self.limit / torch.cuda.get_device_properties(0).total_memory)
        elif active_simulation() is None:  # the CPU workload runs inside one budget (see workload())
            self.sim = autobatch.simulated_memory(self.limit)
            self.sim.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
        elif self.sim is not None:
            self.sim.__exit__(*exc)


def train_plain(step, batch_size: int, steps: int, device: str, limit: int) -> dict:
    began, done = time.perf_counter(), 0
    with Capped(device, limit):
        try:
            for done in range(steps):
                step(batch_size)
            done = steps
        except BaseException as exc:  # noqa: BLE001
            if not is_oom_error(exc):
                raise
            out = {"steps": done, "oom_at": done, "seconds": time.perf_counter() - began,
                   "error": " ".join(str(exc).split())[:300]}
            if device == "cuda":  # how often the allocator had to flush its cache to serve a request
                out["alloc_retries"] = torch.cuda.memory_stats()["num_alloc_retries"]
            return out
    return {"steps": done, "oom_at": None, "seconds": time.perf_counter() - began}


def train_runner(model, optimizer, loss_fn, make, dtype, batch_size: int, steps: int, device: str, limit: int) -> dict:
    with host_memory():  # the runner's data lives on the host (no simulated budget counts it)
        data = [_to_host(make(batch_size)) for _ in range(2)]
    began = time.perf_counter()
    with Capped(device, limit):
        runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=batch_size, micro_batch=batch_size,
                                  autocast_dtype=dtype, progress=False, grow_after=None)
        result = runner.fit(data * (steps // 2 + steps % 2), steps=steps)
    return {"steps": result.steps, "recoveries": result.oom_recoveries, "final_micro_batch": result.micro_batch,
            "seconds": time.perf_counter() - began}


def runs(step, batch_size: int, device: str, limit: int, steps: int = 3) -> bool:
    free_memory()
    try:
        with Capped(device, limit):
            for _ in range(steps):
                step(batch_size)
        return True
    except BaseException as exc:  # noqa: BLE001
        if not is_oom_error(exc):
            raise
    finally:
        free_memory()
    return False


def exact_max(step, answer: int, device: str, limit: int) -> int:
    """Step up from the answer (+1, +2, +4, ...) until 3 steps OOM, then bisect."""
    good, jump = answer, 1
    while runs(step, good + jump, device, limit):
        good, jump = good + jump, jump * 2
    bad = good + jump
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if runs(step, mid, device, limit) else (good, mid)
    return good


def exact_fresh(args, name: str, start: int, steps: int) -> dict:
    """The largest size whose plain loop trains ``steps`` steps in a new process (with
    ``--resumed``, in a resumed one too): up by one from ``start`` while it trains, or down by one
    while it does not; each size's run as it went (the step it ran out of memory at, by form)."""
    forms = ("plain", "plain_resumed") if args.resumed else ("plain",)

    def trains(size: int) -> bool:
        tried[size] = {}
        for form in forms:  # the first form that fails settles it
            ran = fresh_process(args, name, form, size)
            tried[size][form] = ran.get("oom_at", "error") if ran.get("steps") != steps else None
            if tried[size][form] is not None:
                return False
        return True

    tried: dict[int, object] = {}
    size = start
    if trains(size):
        while trains(size + 1):
            size += 1
    else:
        while size > 1 and not trains(size - 1):
            size -= 1
        size -= 1
    return {"batch": size, "oom_at_by_size": tried}


def accelerate_probe(step, start: int, device: str, limit: int) -> dict:
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return {"skipped": "accelerate is not installed"}

    @find_executable_batch_size(starting_batch_size=start)
    def inner(batch_size):
        try:
            for _ in range(3):
                step(batch_size)
        except torch.OutOfMemoryError as exc:
            if device == "cuda":
                raise
            # Accelerate matches message strings; say the simulated OOM in words it knows
            raise RuntimeError(f"CUDA out of memory. (simulated: {str(exc)[:80]})") from None
        return batch_size

    free_memory()
    began = time.perf_counter()
    with Capped(device, limit):
        found = inner()
    return {"batch_size": found, "seconds": time.perf_counter() - began, "start": start}


def fresh_process(args, name: str, form: str, batch_size: int) -> dict:
    command = [sys.executable, __file__, "--child", name, "--form", form, "--batch", str(batch_size),
               "--steps", str(args.steps), "--device", args.device, "--memory-limit", args.memory_limit]
    if args.quick:
        command.append("--quick")
    if args.compile:
        command.append("--compile")
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.child_timeout)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or done.returncode}
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(args) -> None:
    device, limit = args.device, autobatch.parse_bytes(args.memory_limit)
    torch.backends.cudnn.benchmark = args.child.endswith("_tuned")
    if device == "cpu":  # the whole child inside one budget, as in workload()
        with autobatch.simulated_memory(limit):
            return _child(args, device, limit)
    return _child(args, device, limit)


def _child(args, device: str, limit: int) -> None:
    if args.form.startswith("time_"):
        return print(json.dumps(timed_probe(args, args.form[5:], device, limit), default=str))
    model, optimizer, loss_fn, make, dtype, _ = build(args.child, device, args.quick)
    if args.form.endswith("_resumed"):  # plain_resumed, runner_resumed
        make_state(model, optimizer)
    if args.form.startswith("plain"):
        out = train_plain(plain_step(model, optimizer, loss_fn, make, dtype, device), args.batch, args.steps, device, limit)
    else:
        out = train_runner(model, optimizer, loss_fn, make, dtype, args.batch, args.steps, device, limit)
    print(json.dumps(out, default=str))


def make_state(model, optimizer) -> None:
    """Make ``optimizer``'s state before the first training step, where loading a checkpoint
    makes it: one step on zero gradients (its memory, not its values, is what is measured)."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()


def timed_probe(args, form: str, device: str, limit: int) -> dict:
    """One probe, timed, in this (fresh) process after the same untimed warm-up for every form:
    each pays its own first-shape costs (lazily loaded kernels, cuBLAS/cuDNN choices), which a
    probe run second in a shared process would skip."""
    cap = None if device == "cpu" else limit
    warm_up(args.child, device, args.quick)
    model, optimizer, loss_fn, make, dtype, _ = build(args.child, device, args.quick)
    if form == "accelerate":
        out = accelerate_probe(plain_step(model, optimizer, loss_fn, make, dtype, device), args.batch, device, limit)
        return {"batch": out.get("batch_size"), "seconds": round(out.get("seconds", float("nan")), 3)}
    fn = (autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype) if form == "trainstep"
          else plain_step(model, optimizer, loss_fn, make, dtype, device))
    began = time.perf_counter()
    result = autobatch.find_max_batch(fn, memory_limit=cap, device=device, cache=False)
    return {"batch": result.batch_size, "seconds": round(time.perf_counter() - began, 3), "trials": _trial_log(result),
            "fit": result.fit, "notes": result.notes}


def timing(args, name: str, exact: int) -> dict:
    """``--rounds`` rounds of the three probes, each in a fresh process, the order rotated per round."""
    forms = ["trainstep", "plain", "accelerate"]
    runs: dict = {form: [] for form in forms}
    for round_ in range(args.rounds):
        for form in forms[round_ % 3:] + forms[:round_ % 3]:
            start = 2 ** math.ceil(math.log2(exact * 1.05))
            runs[form].append(fresh_process(args, name, f"time_{form}", start))
    return {form: {"median_s": statistics.median(r["seconds"] for r in rows if "seconds" in r) if rows else None,
                   "batches": [r.get("batch") for r in rows], "runs": rows} for form, rows in runs.items()}


def cli_overrides(args, name: str) -> list[str] | None:
    """The workload as the CLI spells it: the same model, optimizer and precision as the library
    forms, so the exact maximum is shared (Llama: a config object built by Hydra, nested _target_);
    None where the CLI has no such model."""
    bf16 = ["precision=bf16"] if args.device == "cuda" else []
    vision = ["data=imagenet", "data.num_classes=10", *bf16]
    gpt2 = ["model.layers=12", "model.width=768", "model.heads=12", "data.vocab_size=50257", "data.seq_len=1024"]
    llama = ["model=target", "model._target_=transformers.LlamaForCausalLM", "+model.config._target_=transformers.LlamaConfig",
             *(f"+model.config.{k}={v}" for k, v in LLAMA.items()), "model.inputs=tokens",
             "data.vocab_size=50257", "data.seq_len=1024", *bf16]
    spelled = {
        "default": [],  # the embedded default, as the README's first command runs it (--cli-only)
        "gpt2": ["model=gpt", *bf16, *([] if args.quick else gpt2)],
        "llama": llama,
        "resnet50": ["model=resnet50", *vision],
        "resnet50_tuned": ["model=resnet50", *vision, "device.cudnn_benchmark=true"],
        "vit_b16": ["model=resnet50", "model._target_=torchvision.models.vit_b_16", *vision],
    }.get(name)
    return None if spelled is None or (name not in ("gpt2", "default") and args.quick) else spelled


def cli(args, name: str) -> dict:
    """``probe`` then ``train`` (a new process, a cache hit); with ``--cli-same`` also ``train``
    probing in its own process (no cache); with ``--cli-bound`` also ``train`` at the smallest size
    above the answer's 0.99 reach (``train.micro_batch``, no probe): a recovery there bounds the
    exact maximum, so the answer is at least 0.99 of it."""
    spelled = cli_overrides(args, name)
    if spelled is None:
        return {"skipped": "the CLI has no such built-in model"}
    with tempfile.TemporaryDirectory() as tmp:
        cap = [] if args.memory_limit == "none" else [f"probe.memory_limit={args.memory_limit}"]
        common = [*spelled, f"device.type={args.device}", *cap, f"probe.cache_dir={tmp}/cache", *args.cli_args]
        out: dict = {}
        probed = _cli_command(args, tmp, "probe", common, [], out)
        if probed is None:
            return out
        out["probe_trials"] = [(t["batch_size"], t["passed"], t["purpose"], t.get("wall_bytes"), t.get("steps"),
                                t.get("flushes"), (t.get("error") or "")[:160]) for t in probed.get("trials", [])]
        out["probe_notes"] = probed.get("notes", [])[:3]
        runs = {"train": []}
        if args.cli_same:
            runs["train_same"] = ["probe.cache=false"]
        answer = probed["batch_size"]
        if args.cli_bound:
            bound = max(answer + 1, math.ceil(answer / 0.99))
            runs["train_bound"] = [f"train.micro_batch={bound}", f"train.global_batch={bound}", "probe.cache=false"]
        for command, extra in runs.items():
            steps = args.bound_steps if command == "train_bound" else args.steps
            summary = _cli_command(args, tmp, command, common, [*extra, f"train.steps={steps}"], out)
            if summary is not None:
                out[command] = _trained(summary)
        out.update(batch=answer, **{k: v for k, v in out.get("train", {}).items() if k != "batch"})
        return out


def _cli_command(args, tmp: str, label: str, common: list[str], extra: list[str], out: dict) -> dict | None:
    """Run one CLI command in a new process; its result JSON (None on a failure, said in ``out``)."""
    command = label.split("_")[0]
    run_dir = f"{tmp}/{label}"
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autobatch", command, *common, *extra, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=args.child_timeout, cwd=tmp)
    out[f"{label}_seconds"] = round(time.perf_counter() - began, 2)
    if done.returncode != 0:
        out[f"{label}_error"] = done.stderr.strip().splitlines()[-3:]
        return None
    return json.loads((Path(run_dir) / ("result.json" if command == "probe" else "train_result.json")).read_text())


def _trained(summary: dict) -> dict:
    """What a ``train`` run did: its answer, steps, micro-batch and each OOM recovery."""
    return dict(batch=summary["probe"]["batch_size"] if summary.get("probe") else None, steps=summary["steps"],
                recoveries=len(summary["oom_recoveries"]), final_micro_batch=summary["micro_batch"],
                samples_per_s=round(summary["samples_per_s"], 1),
                recovered=[(r["step"], r["phase"], r["micro_batch_before"], r["micro_batch"], r.get("error", "")[:300])
                           for r in summary["oom_recoveries"]])


# -- one workload ------------------------------------------------------------------------------------
def workload(args, name: str) -> dict:
    """One workload; on the CPU inside one simulated budget, so that state created by a probe
    (a plain callable's Adam moments) keeps counting afterwards, as it does on a GPU."""
    if args.device != "cpu":
        return _workload(args, name, autobatch.parse_bytes(args.memory_limit))
    with autobatch.simulated_memory(args.memory_limit):
        return _workload(args, name, None)


def _trial_log(result) -> list:
    """Each trial: size, passed, steps, purpose, seconds (where the probe's time went), and its
    memory figures in MiB: allocated peak, reserved peak, last step's peak, fragmentation,
    split bytes, over, wall (what the search reads at the allocator's wall); then whether it
    autotuned and how many steps after its first flushed the allocator's cache."""
    def mib(value):
        return None if value is None else round(value / 2**20, 1)
    return [(t.batch_size, t.passed, t.steps, t.purpose, round(t.seconds, 3), mib(t.peak_bytes), mib(t.reserved_bytes),
             mib(t.step_peak_bytes), mib(t.fragmentation_bytes), mib(t.inactive_split_bytes), mib(t.over_bytes),
             mib(t.wall_bytes), t.autotuned, t.flushes) for t in result.trials]


def warm_up(name: str, device: str, quick: bool) -> None:
    """Two steps at batch 2 on a throwaway copy, untimed: kernels loaded, cuBLAS and cuDNN handles
    made, so that the first timed probe does not pay the process's warm-up the others skip."""
    model, optimizer, loss_fn, make, dtype, _ = build(name, device, quick)
    step = plain_step(model, optimizer, loss_fn, make, dtype, device)
    for _ in range(2):
        step(2)
    del model, optimizer, step
    free_memory()


def _workload(args, name: str, cap: int | None) -> dict:
    device, limit = args.device, autobatch.parse_bytes(args.memory_limit)
    user_setting = name.endswith("_tuned")
    torch.backends.cudnn.benchmark = user_setting
    row: dict = {"workload": name, "cudnn_benchmark": user_setting}
    warm_up(name, device, args.quick)
    if args.timing_only:  # the exact maximum from a plain probe's answer, then the fresh-process timings
        model, optimizer, loss_fn, make, dtype, _ = build(name, device, args.quick)
        step = plain_step(model, optimizer, loss_fn, make, dtype, device)
        answer = autobatch.find_max_batch(step, memory_limit=cap, device=device, cache=False).batch_size
        row["exact_max"] = exact_max(step, answer, device, limit)
        del model, optimizer, step
        free_memory()
        row["timing"] = timing(args, name, row["exact_max"])
        return row
    model, optimizer, loss_fn, make, dtype, _ = build(name, device, args.quick)
    ts = autobatch.TrainStep(model, optimizer, loss_fn, make, autocast_dtype=dtype)
    began = time.perf_counter()
    result = autobatch.find_max_batch(ts, memory_limit=cap, cache=False)
    row["trainstep"] = {"batch": result.batch_size, "probe_s": round(time.perf_counter() - began, 3),
                        "trials": result.num_trials, "promise": result.promise, "trial_log": _trial_log(result),
                        "benchmark_restored": torch.backends.cudnn.benchmark is user_setting}
    row["trainstep"]["same_process"] = train_runner(model, optimizer, loss_fn, make, dtype, result.batch_size,
                                                    args.steps, device, limit)
    del model, optimizer, ts
    free_memory()
    model, optimizer, loss_fn, make, dtype, _ = build(name, device, args.quick)
    step = plain_step(model, optimizer, loss_fn, make, dtype, device)
    began = time.perf_counter()
    result = autobatch.find_max_batch(step, memory_limit=cap, device=device, cache=False)
    row["plain"] = {"batch": result.batch_size, "probe_s": round(time.perf_counter() - began, 3),
                    "trials": result.num_trials, "promise": result.promise, "trial_log": _trial_log(result)}
    row["plain"]["same_process"] = train_plain(step, result.batch_size, args.steps, device, limit)
    exact = exact_max(step, min(row["plain"]["batch"], row["trainstep"]["batch"]), device, limit)
    row["exact_max"] = exact
    for form in ("trainstep", "plain"):
        row[form]["of_exact"] = round(row[form]["batch"] / exact, 4)
    row["accelerate"] = accelerate_probe(step, 2 ** math.ceil(math.log2(exact * 1.05)), device, limit)
    del model, optimizer, step
    free_memory()
    if args.exact_fresh:
        row["exact_fresh"] = exact_fresh(args, name, min(row["plain"]["batch"], row["trainstep"]["batch"]), args.steps)
        for form in ("trainstep", "plain"):
            row[form]["of_exact_fresh"] = round(row[form]["batch"] / max(1, row["exact_fresh"]["batch"]), 4)
    children = (("trainstep", "runner"), ("plain", "plain"))
    if args.resumed:  # each answer in a resumed new process too
        children += (("trainstep", "runner_resumed"), ("plain", "plain_resumed"))
    for form, child_form in children:
        # several new processes: a size at the allocator's wall passes some runs and fails others
        runs_ = [fresh_process(args, name, child_form, row[form]["batch"]) for _ in range(args.fresh_runs)]
        row[form]["fresh_process" if not child_form.endswith("_resumed") else "resumed_process"] = runs_[0] if len(runs_) == 1 else {
            "runs": len(runs_), "failed": sum(1 for r in runs_ if r.get("oom_at") is not None or r.get("recoveries")
                                              or "error" in r and "steps" not in r), "each": runs_}
    if COMPILE:  # how often the probes and trainings made dynamo capture and compile a graph
        from torch._dynamo.utils import counters
        row["dynamo"] = {key: dict(value) for key, value in counters.items() if key in ("stats", "recompiles")}
    if args.cli:
        row["cli"] = cli(args, name)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps (CPU: seconds)")
    parser.add_argument("--memory-limit", default=None,
                        help="per-process cap (default 8GiB; 16MiB on the CPU); 'none' probes the whole device "
                             "(--cli-only: e.g. --workloads default, the README's probe then train)")
    parser.add_argument("--steps", type=int, default=None, help="training steps at the answer (default 200; --quick 5)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--cli", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--timing-only", action="store_true",
                        help="only the exact maximum and each probe's wall time in fresh processes (--rounds)")
    parser.add_argument("--cli-only", action="store_true", help="only the CLI's probe then train, per workload")
    parser.add_argument("--cli-same", action="store_true",
                        help="also the CLI's train probing in its own process (probe.cache=false)")
    parser.add_argument("--cli-bound", action="store_true",
                        help="also the CLI's train at the smallest size above the answer's 0.99 reach (no probe)")
    parser.add_argument("--bound-steps", type=int, default=20, help="steps of the --cli-bound run")
    parser.add_argument("--cli-args", nargs="*", default=[], help="more overrides for every CLI command")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fresh-runs", type=int, default=1, help="new processes per form that train at the answer")
    parser.add_argument("--exact-fresh", action="store_true",
                        help="also the largest size a plain loop trains --steps steps at in new processes")
    parser.add_argument("--resumed", action="store_true",
                        help="--exact-fresh: the size must also train where the optimizer state exists before step 0")
    parser.add_argument("--compile", action="store_true", help="every form trains the model under torch.compile")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--form", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global COMPILE
    COMPILE = args.compile
    args.memory_limit = args.memory_limit or ("16MiB" if args.device == "cpu" else ("2GiB" if args.quick else "8GiB"))
    if args.memory_limit == "none" and not args.cli_only:
        parser.error("--memory-limit none is for --cli-only (the library forms and Accelerate run under a cap)")
    args.steps = args.steps or (5 if args.quick else 200)
    if args.child:
        return child(args)
    began, rows = time.perf_counter(), []
    env = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (simulated)",
           "torch": torch.__version__, "memory_limit": args.memory_limit, "steps": args.steps,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "cli_args": args.cli_args}
    print(json.dumps(env))
    for name in args.workloads.split(","):
        if args.cli_only:
            rows.append({"workload": name, "cli": cli(args, name)})
            print(f"{name:15s} cli {rows[-1]['cli']}", flush=True)
            continue
        row = workload(args, name)
        rows.append(row)
        if args.timing_only:
            print(f"{name:15s} exact {row['exact_max']:6d} | " + " | ".join(
                f"{form} {v['batches']} median {v['median_s']}s" for form, v in row["timing"].items()), flush=True)
            continue
        t, p = row["trainstep"], row["plain"]
        print(f"{name:15s} exact {row['exact_max']:6d} | TrainStep {t['batch']} ({t['of_exact']:.3f}) {t['probe_s']:.2f}s "
              f"same {len(t['same_process']['recoveries'])} rec, fresh {t['fresh_process']} | plain {p['batch']} "
              f"({p['of_exact']:.3f}) {p['probe_s']:.2f}s same oom_at {p['same_process']['oom_at']}, fresh "
              f"{p['fresh_process']} | accelerate {row['accelerate']} | cli {row.get('cli')}"
              + (f" | exact in new processes {row['exact_fresh']}" if "exact_fresh" in row else ""), flush=True)
    print(f"total {time.perf_counter() - began:.1f}s")
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
