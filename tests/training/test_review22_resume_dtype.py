"""Review 22: a checkpoint of another parameter dtype resumed with a silent cast.

Saved from a bfloat16 model and resumed into a float32 one (or the reverse), ``load_state_dict``
cast every weight without a word. Now one warning names the dtypes (the narrowing one says the
checkpoint's precision is rounded off in this run); weights float16 cannot hold (inf) are refused
before anything is loaded.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autobatch import CheckpointError, Runner

G = 8


def _data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(G, 4, generator=generator), torch.randn(G, 1, generator=generator)) for _ in range(2)]


def _loss(model, batch):
    return nn.functional.mse_loss(model(batch[0].to(model[0].weight.dtype)).float(), batch[1])


def _runner(dtype, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, global_batch=G, micro_batch=G,
                  progress=False, **options)


@pytest.mark.parametrize("saved, resumed, rounded", [(torch.bfloat16, torch.float32, False),
                                                     (torch.float32, torch.bfloat16, True)])
def test_a_resume_into_another_dtype_warns_once_naming_both(tmp_path, caplog, saved, resumed, rounded):
    _runner(saved, checkpoint_dir=tmp_path).fit(_data(), epochs=1)
    runner = _runner(resumed)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        runner.fit(_data(), epochs=2, resume=tmp_path)
    warned = [r.getMessage() for r in caplog.records if "another dtype" in r.getMessage()]
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    assert len(warned) == 1 and f"saved in {name(saved)} load into this run's {name(resumed)}" in warned[0]
    assert ("rounded" in warned[0]) is rounded
    assert runner.model[0].weight.dtype == resumed and runner.step == 2 * len(_data())


def test_weights_float16_cannot_hold_are_refused_before_loading(tmp_path):
    runner = _runner(torch.float32, checkpoint_dir=tmp_path)
    with torch.no_grad():
        runner.model[0].weight[0, 0] = 1e6
    runner.save()
    resumed = _runner(torch.float16)
    before = resumed.model[0].weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"0\.weight \(float32\) holds values above float16's range"):
        resumed.fit(_data(), epochs=1, resume=tmp_path)
    assert torch.equal(resumed.model[0].weight, before)  # nothing loaded
