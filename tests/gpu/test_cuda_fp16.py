"""fp16 on a real GPU: the Runner counts the steps ``GradScaler`` skipped without the host waiting
for the device every step. Skipped without CUDA.

``GradScaler.get_scale()`` reads the scale with ``.item()``; the runner called it twice a step
to count skipped steps, so the host waited for the device each step and could not queue the
next step's kernels behind the running ones. With a fused optimizer (whose step takes the
scaler's inf check on the device) nothing else in a step needs to wait.
"""

import warnings

import pytest
import torch
from torch.nn import functional as F

import autobatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_fp16_skipped_steps_are_counted_without_a_host_wait_per_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    data = [(torch.randn(64, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda")) for _ in range(12)]
    for poisoned in (2, 7):  # a non-finite input: the scaler skips the step and backs off
        data[poisoned][0][3, 5] = float("inf")
    runner = autobatch.Runner(model, optimizer, lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]),
                              global_batch=64, micro_batch=32, autocast_dtype="float16", grad_scaler=scaler,
                              progress=False, log_every=None, grow_after=None)
    runner.fit(data, steps=1)  # the first step makes the optimizer's state and the scaler's tensors
    waits = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = runner.fit(data, steps=len(data))  # goes on from the second batch
        waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.skipped_steps == 2, result.skipped_steps
    steps = len(data) - 1
    assert len(waits) < steps, f"{len(waits)} host waits in {steps} steps: {sorted(set(waits))}"


@pytest.mark.parametrize("autocast", [torch.float16, "float16", "autocast-object"])
def test_accumulate_gradients_autocasts_on_the_models_cuda_device(autocast):
    """``accumulate_gradients(autocast=torch.float16)`` (or its name, or a ``torch.autocast``) runs each
    micro-batch's forward under CUDA's fp16 autocast, the model's device, not the CPU's; with a
    ``GradScaler`` the unscaled gradients equal one scaled backward over the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 1, device="cuda")
    seen = []

    def loss_fn(m, batch):
        out = m(batch[0])
        seen.append(out.dtype)
        return F.mse_loss(out.float(), batch[1])

    context = torch.autocast("cuda", dtype=torch.float16) if autocast == "autocast-object" else autocast
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    autobatch.accumulate_gradients(model, loss_fn, (x, y), 8, autocast=context, grad_scaler=scaler)
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        whole = F.mse_loss(model(x).float(), y)
    (whole * 1024.0).backward()
    assert seen == [torch.float16] * 4
    for got, p in zip(split, model.parameters()):
        torch.testing.assert_close(got, p.grad / 1024.0, rtol=2e-3, atol=2e-4)
