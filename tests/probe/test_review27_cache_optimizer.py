"""The probe cache, reviewed as a user changing one thing at a time: an optimizer's
``maximize=True`` negates every gradient into a new tensor in its step (the largest gradient's
size more at the peak), but the key left it out, so a maximizing run was served the answer
measured without it."""

import torch

import autobatch
from autobatch import cache as probe_cache


def _step(**options) -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), **{"lr": 1e-3, **options})
    return autobatch.TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 128))


def _key(step: autobatch.TrainStep) -> str:
    return probe_cache.key_of(
        probe_cache.key_components(step, device="cpu", capacity=2**25, memory_limit=2**25, probe={})
    )


def test_maximize_changes_the_peak_and_the_key():
    """``maximize=True`` raises the step's peak (the negated gradient), so it must miss; the
    learning rate and betas change no memory, so they must still hit."""
    plain, maximizing = _step(), _step(maximize=True)
    assert autobatch.estimate_peak(maximizing, 4) > autobatch.estimate_peak(plain, 4)
    assert _key(maximizing) != _key(plain)
    assert _key(_step(lr=0.5, betas=(0.8, 0.9))) == _key(plain)
