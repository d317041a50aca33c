"""Step forms of review 20: a grad scaler beside a model kept in float16.

torch's GradScaler unscales float32 gradients only; beside a ``model.half()`` every step raised
its bare "Attempting to unscale FP16 gradients." from the probe's first trial (or the first step
of a run), naming neither the parameters nor the change to make.
"""

import pytest
import torch

import autobatch


def _step(model, scaler, **options):
    optimizer = torch.optim.AdamW(model.parameters())
    return autobatch.TrainStep(
        model, optimizer, lambda m, batch: m(batch).float().square().mean(),
        lambda n: torch.randn(n, 4, dtype=next(model.parameters()).dtype), grad_scaler=scaler, **options)


def test_a_grad_scaler_beside_float16_parameters_is_refused_saying_what_to_change():
    with pytest.raises(ValueError, match=r"float16 parameter\(s\) \(the first: '0.weight'\).*autocast_dtype=torch.float16"):
        _step(torch.nn.Sequential(torch.nn.Linear(4, 4)).half(), torch.amp.GradScaler("cpu"))
    # a disabled scaler unscales nothing, and bfloat16 gradients unscale: both train as before
    for model, scaler in ((torch.nn.Linear(4, 4).half(), torch.amp.GradScaler("cpu", enabled=False)),
                          (torch.nn.Linear(4, 4).to(torch.bfloat16), torch.amp.GradScaler("cpu"))):
        _step(model, scaler)(3)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_model_cast_to_float16_after_the_step_was_built_gets_the_advice_as_a_note(clip):
    model = torch.nn.Linear(4, 4)
    step = _step(model, torch.amp.GradScaler("cpu"), max_grad_norm=clip)
    model.half()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as raised:
        step(3)
    assert any("autocast_dtype=torch.float16" in note for note in raised.value.__notes__)
