"""A step whose estimated peak is flat at small batches: ``auto``'s estimate still places its
first trial.

The README's quickstart model (an MLP 512→2048→10 with AdamW) under ``memory_limit="64MiB"``
peaks in AdamW's step (its temporaries and state, constant in the batch) up to a few hundred
samples, so the quick estimate's traces at 16 and 256 were equal: ``auto`` noted "estimated peak
does not grow with the batch", probed from the start and took 9 trials with 3 OOMs. The quick
estimate now traces on by ``GROWTH`` until the peak grows and closes with a secant on the rising
part: 4 traces, the exact estimated boundary, and 3 trials.
"""

from __future__ import annotations

import pytest
import torch

from autobatch import TrainStep, find_max_batch
import autobatch.probe.tracing.estimate as estimate_mod
from autobatch.probe.tracing.estimate import EstimateError, estimate_line, estimate_max_batch


def _readme_step() -> TrainStep:
    """README.md's library quickstart, on the CPU."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    loss_fn = lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    return TrainStep(model, optimizer, loss_fn,
                     make_batch=lambda B: (torch.randn(B, 512), torch.randint(0, 10, (B,))))


def test_readme_model_probes_from_the_estimate_in_at_most_four_trials():
    reference = find_max_batch(_readme_step(), memory_limit="64MiB", strategy="binary", cache=False)
    result = find_max_batch(_readme_step(), memory_limit="64MiB", cache=False)
    assert result.batch_size == reference.batch_size
    assert len(result.trials) <= 4, [(t.batch_size, t.passed) for t in result.trials]
    assert any(n.startswith("first trial placed by an estimate") for n in result.notes), result.notes
    assert result.estimate is not None and result.estimate["batch_size"] > 256  # past the flat start


def test_quick_estimate_traces_past_a_flat_start_to_the_exact_boundary():
    step = _readme_step()
    peaks = {b: e.step_peak_bytes for b, e in
             ((e.batch_size, e) for e in estimate_line(step, "64MiB", include_resident=False).estimates)}
    assert peaks[16] == peaks[256]  # the optimizer step's constant peak: the reason it traced on
    quick = estimate_line(step, "64MiB", include_resident=False)
    exact = estimate_max_batch(step, "64MiB", include_resident=False)
    assert len(quick.estimates) <= 4
    assert quick.batch_size == exact.batch_size
    assert quick.slope_bytes_per_sample > 0


@pytest.mark.parametrize("max_batch", [None, 1000])
def test_a_peak_that_never_grows_is_still_refused_after_a_few_traces(max_batch, monkeypatch):
    model = torch.nn.Linear(8, 8)
    step = TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: m(b).pow(2).mean(),
                     lambda n: torch.randn(1, 8))  # one sample whatever the batch: memory that never grows
    traced = []
    real = estimate_mod.estimate_memory
    monkeypatch.setattr(estimate_mod, "estimate_memory", lambda s, b, **k: traced.append(b) or real(s, b, **k))
    with pytest.raises(EstimateError, match="does not grow"):
        estimate_line(step, "64MiB", include_resident=False, max_batch=max_batch)
    assert 3 <= len(traced) <= 7, traced  # 16, 256, then by GROWTH to GROWTH**6 (or max_batch) at most
