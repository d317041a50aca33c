"""Review 18: the estimate on models its authors did not try: a LayerNorm whose output gradient
is transposed (Swin's pooler), and a value read inside torch's own code (``nn.Transformer``'s
mask check)."""

import pytest
import torch

from torch._subclasses.fake_tensor import FakeTensorMode

from autobatch import TrainStep, estimate_memory
from autobatch.probe.tracing.estimate import EstimateError
from autobatch.probe.tracing.fake_trace import KernelDtypes


def test_a_layer_norm_gradient_has_the_real_kernels_layout():
    """Swin pools its last LayerNorm's output through a transpose, so that LayerNorm's output
    gradient is transposed: the fake backward returned the input gradient with those strides, the
    real kernels a contiguous one, and the Linear's backward then copied it in the trace only (a
    small transformers Swin was estimated 1.2-1.4 % above its measured peak, exact now)."""
    layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default
    torch.manual_seed(0)
    x, weight, bias = torch.randn(4, 64, 32), torch.ones(32), torch.zeros(32)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [32], weight, bias, 1e-5)
    grad = torch.randn(4, 32, 64).transpose(1, 2)
    real = layer_norm_backward(grad, x, [32], mean, rstd, weight, bias, [True, True, True])
    with FakeTensorMode() as mode, KernelDtypes():
        fakes = [mode.from_tensor(t) for t in (grad, x, mean, rstd, weight, bias)]
        fake = layer_norm_backward(fakes[0], fakes[1], [32], *fakes[2:], [True, True, True])
    assert [tuple(t.stride()) for t in fake] == [tuple(t.stride()) for t in real]


def test_a_value_read_in_torch_code_names_the_torch_function():
    """``nn.Transformer`` compares a ``tgt_mask`` with a causal one by value (``tgt_is_causal``
    not passed): the message named only the user's line calling the model, not what read a value."""
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8,
                                 batch_first=True)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)

    def loss(m, batch):
        return m(batch[0], batch[1], tgt_mask=mask.to(batch[1].device)).square().mean()

    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss,
                     lambda n: (torch.randn(n, 4, 8), torch.randn(n, 4, 8)))
    with pytest.raises(EstimateError, match=r"in loss, inside torch\.nn\.modules\.transformer\._detect_is_causal_mask"):
        estimate_memory(step, 4)
