"""A ``torch.compile``d model on a real GPU: probed (trials and the fake-tensor estimate), it still
compiles after the probe. Skipped without CUDA; run with ``bash scripts/gpu_tests.sh``.

Dynamo marks the code it meets under a torch dispatch mode skipped for good; the estimate's trace is
one, so before ``autobatch.memory.uncompiled`` a compiled model estimated on the GPU trained uncompiled
for the rest of the process, with no word (``tests/probe/test_compiled.py`` checks the CPU's side)."""

import pytest
import torch

import autobatch
from autobatch import find_max_batch
from test_cuda_probe import _clean_cuda  # noqa: E402,F401 - its autouse fixture: memory freed around each test

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _compiled_step(compiles: list) -> autobatch.TrainStep:
    """A small CNN compiled with a backend that counts its graphs and runs them as traced (no codegen:
    what is checked is whether dynamo compiles, not how fast)."""

    def backend(graph, inputs):
        compiles.append(graph)
        return graph.forward

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3, padding=1),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    ).cuda()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    return autobatch.TrainStep(
        compiled, torch.optim.AdamW(model.parameters(), lr=1e-3),
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        lambda n: (torch.randn(n, 3, 64, 64, device="cuda"), torch.randint(0, 10, (n,), device="cuda")),
    )


@pytest.mark.parametrize("strategy", ["estimate", "auto"])
def test_a_compiled_model_compiles_after_its_probe_on_cuda(strategy):
    torch._dynamo.reset()
    compiles: list = []
    step = _compiled_step(compiles)
    result = find_max_batch(step, memory_limit="1GiB", strategy=strategy, cache=False,
                            estimate_first=True if strategy == "auto" else None)
    assert result.batch_size >= 8
    before = len(compiles)
    step(8)  # a training step after the probe: dynamo compiles its frames (fullgraph: or raises)
    assert len(compiles) > before or before > 0  # before the fix: none at all, the code marked skipped
