"""Transformers decoders checkpointed by autobatch on a GPU: gradients against the plain model,
and a plan that needs checkpointing, trained (issue 16's planning pillar; the thirty-second
session's fix for a key/value cache handed to a layer positionally, GPT-2's).

For each model (GPT-2 and Llama from small configs, 2048 tokens on a GPU, default ``use_cache=True``, dropout off), a
batch with a padding ``attention_mask``: the largest gradient difference between the model with
its blocks wrapped by ``enable_checkpointing`` and without (float32), the peak of one step each
way, then ``plan(global_batch=16)`` under a cap between the two peaks at batch 1 (so batch 1
fits only with checkpointing) and 10 ``Runner`` steps of that plan.

    python scripts/diag_hf_checkpointing.py --device cuda
    python scripts/diag_hf_checkpointing.py --device cpu      (simulated budgets; seconds)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autobatch  # noqa: E402
from autobatch.planning.checkpointing import enable_checkpointing  # noqa: E402


#: width, vocabulary and layers per device (blocks' activations outweigh the logits on a GPU): a GPU's decoder, and one the CPU's simulated budget holds
SIZES = {"cuda": (512, 2048, 12), "cpu": (64, 512, 6)}
VOCAB = 8192


def build(name: str, device: str, tokens: int):
    import transformers

    global VOCAB
    width, VOCAB, layers = SIZES["cuda" if device == "cuda" else "cpu"]
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=8, n_positions=tokens, vocab_size=VOCAB,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).to(device)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 11 // 4,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=tokens)
    return transformers.LlamaForCausalLM(config).to(device)


def batch_of(n: int, tokens: int, device: str, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, tokens), generator=generator)
    mask = torch.ones(n, tokens, dtype=torch.long)
    mask[:, tokens - tokens // 4:] = 0  # a padded tail
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": ids.to(device)}


def loss_fn(model, batch):
    return model(**batch).loss


def peak_of_step(model, batch, device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def one(name: str, device: str, tokens: int) -> None:
    torch.manual_seed(0)
    model = build(name, device, tokens)
    model.train()
    batch = batch_of(2, tokens, device)
    wrapped = copy.deepcopy(model)
    handle = enable_checkpointing(wrapped)
    grads = []
    for m in (model, wrapped):
        loss_fn(m, batch).backward()
        grads.append([p.grad.detach().clone() for p in m.parameters()])
        m.zero_grad(set_to_none=True)
    diff = max((a - b).abs().max().item() for a, b in zip(*grads))
    one_batch = batch_of(1, tokens, device)
    plain_peak, wrapped_peak = peak_of_step(model, one_batch, device), peak_of_step(wrapped, one_batch, device)
    print(f"{name}: {len(handle.modules) if hasattr(handle, 'modules') else '?'} blocks wrapped, largest gradient "
          f"difference {diff:.2e}; peak at batch 1 {plain_peak} plain, {wrapped_peak} checkpointed", flush=True)
    handle.undo()
    del wrapped
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = autobatch.TrainStep(model, optimizer, loss_fn, make_batch=lambda n: batch_of(n, tokens, device))
    if device == "cuda":
        state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # AdamW's, made by the first step
        cap = (plain_peak + wrapped_peak) // 2 + state
        try:
            plan = autobatch.plan(step, global_batch=16, memory_limit=cap)
        except autobatch.NoBatchFitsError as error:
            print(f"{name}: no plan under {cap} bytes: {str(error)[:300]}", flush=True)
            return
    else:
        with autobatch.simulated_memory("12MiB"):
            plan = autobatch.plan(step, global_batch=16)
    print(f"{name}: plan {plan.micro_batch} x {plan.accumulation_steps}, checkpointing {plan.checkpointing} "
          f"({len(plan.checkpointed_modules or [])} blocks)", flush=True)
    runner = autobatch.Runner(model, optimizer, loss_fn, global_batch=16, micro_batch=plan.micro_batch, progress=False)
    data = [batch_of(16, tokens, device, seed=s) for s in range(10)]
    result = runner.fit(data, epochs=1)
    print(f"{name}: trained {result.steps} steps, {len(result.oom_recoveries)} recoveries, last loss {result.last_loss:.3f}")
    plan.undo()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--tokens", type=int, default=None)
    args = parser.parse_args()
    import transformers

    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    tokens = args.tokens or (2048 if args.device == "cuda" else 64)
    for name in args.models.split(","):
        one(name, args.device, tokens)


if __name__ == "__main__":
    main()
