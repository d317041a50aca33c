"""Real-GPU check of the decorator in Accelerate's own example shape: the model, optimizer and
loader built and ``accelerator.prepare``d inside the decorated loop. Every retry starts from the
memory the first attempt started from (a failed attempt's frames are not kept: reading a running
frame's locals keeps them on Python < 3.13), it takes at most one attempt more than Accelerate's
decorator on the same loop and cap (its once-a-call ×0.95 step), and its size is within ×0.9 of the smallest size that failed (the two
land on different grids: which is larger depends on where the capacity falls).
Skipped without CUDA (or accelerate); run with ``bash scripts/gpu_tests.sh``."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
accelerate = pytest.importorskip("accelerate")

from autobatch import find_executable_batch_size, free_memory  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CAP = 2 * 2**30
START = 65536


def _loop(decorator, accelerator, data, starts):
    @decorator(starting_batch_size=START)
    def inner_training_loop(batch_size):
        accelerator.free_memory()
        starts.append(torch.cuda.memory_allocated())
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return batch_size
    return inner_training_loop


def test_the_canonical_accelerate_loop_frees_each_attempt_and_finds_at_least_accelerates_size():
    free_memory()
    data = torch.utils.data.TensorDataset(torch.randn(2 * START, 256), torch.randn(2 * START, 1))
    accelerator = accelerate.Accelerator()
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    found, wrapped = {}, None
    try:
        for name, decorator in (("accelerate", accelerate.utils.find_executable_batch_size),
                                ("autobatch", find_executable_batch_size)):
            starts: list[int] = []
            loop = _loop(decorator, accelerator, data, starts)
            found[name] = (loop(), starts)
            wrapped = loop if name == "autobatch" else wrapped
            accelerator.free_memory()
            free_memory()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    ours, starts = found["autobatch"]
    theirs = found["accelerate"][0]
    print({name: (size, [round(s / 2**20) for s in at]) for name, (size, at) in found.items()})
    assert len(starts) > 1 and max(starts) - starts[0] < 16 * 2**20, starts  # no attempt kept in memory
    failed = [a.batch_size for a in wrapped.attempts if not a.ok]
    assert len(starts) <= len(found["accelerate"][1]) + 1, found  # at most the one finer step more (decorator_steps)
    assert failed and ours >= 0.9 * min(failed) - 1, (ours, failed)
