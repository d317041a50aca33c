"""A step fake tensors cannot trace: the EstimateError says what the step did, in the words of
its code (not only PyTorch's ``aten._local_scalar_dense``), and the line that did it (review 13)."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch.probe.tracing.estimate import EstimateError


class Branchy(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if self.kind == "branch" and h.mean() > 0:  # reads the value: data-dependent control flow
            h = h * 2
        if self.kind == "mask":
            h = h[h[:, 0] > 0]  # its shape depends on the data
        return self.b(h)


def _step(kind: str) -> autobatch.TrainStep:
    model = Branchy(kind)
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).pow(2).mean(), lambda n: torch.randn(n, 8))


@pytest.mark.parametrize("kind, said", [
    ("branch", "reads a tensor's value in Python, by .item(), float(), int(), bool() or `if tensor:`"),
    ("mask", "an output's shape depends on the data, as after nonzero, boolean-mask indexing or unique"),
])
def test_the_error_says_what_the_step_did_and_where(kind, said):
    with pytest.raises(EstimateError) as caught:
        autobatch.estimate_max_batch(_step(kind), "1GiB")
    message = str(caught.value)
    assert said in message
    assert f"at {__file__}:" in message and " in forward" in message
    assert message.endswith("; probe with real trials (strategy='binary', or 'auto' with estimate_first=False)")


def test_auto_probes_with_trials_and_its_note_names_the_line():
    result = autobatch.find_max_batch(_step("branch"), memory_limit="1MiB", cache=False)
    assert result.tested and any(f"at {__file__}:" in note for note in result.notes)
