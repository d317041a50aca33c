"""Review 20: the estimate on steps its authors did not try: an optimizer given its
hyperparameters as tensors, and a mixture of experts' grouped matrix product in float32."""

import pytest
import torch

from autobatch import TrainStep, estimate_memory, simulated_memory


def _measured(step: TrainStep, batch_size: int) -> int:
    with simulated_memory("1GiB") as simulation:
        for _ in range(3):
            step(batch_size)
    return simulation.peak_bytes


def test_tensor_hyperparameters_are_read_by_value():
    """``AdamW(lr=torch.tensor(...), betas=(torch.tensor(...), ...))`` (a schedule that writes the
    tensor in place) trains, but its step reads ``1 - beta2`` as a number: the fake of a real tensor
    has none, and the estimate was refused with a value read at a line of torch's ``adam.py``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3),
                                  betas=(torch.tensor(0.9), torch.tensor(0.999)))
    step = TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 16))
    estimated = estimate_memory(step, 8).step_peak_bytes
    assert estimated == pytest.approx(_measured(step, 8), rel=0.005)
    assert all(type(beta) is torch.Tensor for beta in optimizer.param_groups[0]["betas"])  # the real group untouched


class Experts(torch.nn.Module):
    """Four experts applied with ``torch._grouped_mm``, as transformers' Mixtral and Qwen-MoE do."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, outputs, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(1, 5, dtype=torch.int32) * (tokens.shape[0] // 4)  # tokens routed evenly
        return torch._grouped_mm(tokens, self.weight.transpose(1, 2), offsets)


def _experts_step(outputs: int) -> TrainStep:
    model = Experts(outputs)
    return TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).square().mean(),
                     lambda n: torch.randn(n, 8))


def test_a_float32_grouped_matrix_product_is_estimated():
    """PyTorch's meta kernel of ``_grouped_mm`` takes only bfloat16, where the kernel takes float32 and
    float16 too: a float32 Mixtral, which trains, was refused as the step's own error ("Expected inputs
    of BF16 type"). Now exact; a layout the kernel refuses is still the step's own error."""
    step = _experts_step(outputs=32)
    assert estimate_memory(step, 16).step_peak_bytes == _measured(step, 16)
    with pytest.raises(RuntimeError, match="strides should be multiple of 16 bytes"):
        estimate_memory(_experts_step(outputs=30), 16)  # its output gradient's rows: 120 bytes, as in the real step
