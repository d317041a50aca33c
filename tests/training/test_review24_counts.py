"""The counts validated outside ``autobatch.checks`` (``grow_after``, ``empty_cache_every``,
``log_every``, a fault's ``times``) each had their own wording and said nothing of what to pass
for ``4.0`` or ``"4"``; they use :func:`autobatch.checks.count`, with the public API's hint."""

from __future__ import annotations

import pytest
import torch

from autobatch import Runner
from autobatch.training.oom.faults import FaultInjector
from autobatch.training.oom.growth import GrowBack
from autobatch.training.hygiene import CachePolicy


def _runner(**options):
    model = torch.nn.Linear(2, 1)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).sum(), global_batch=2,
                  device="cpu", progress=False, **options)


@pytest.mark.parametrize("name", ["grow_after", "empty_cache_every", "log_every"])
@pytest.mark.parametrize("value, hint", [(4.0, "4.0; pass an int, e.g. {name}=4"),
                                         ("4", r"'4'; pass an int, e.g. {name}=4 \(not the string '4'\)"),
                                         (True, "True"), (-1, "-1")])
def test_a_count_of_another_kind_says_what_to_pass(name, value, hint):
    with pytest.raises(ValueError, match=rf"^{name} must be an integer >= 0 or None \(0 or None: [a-z ]+\), got "
                                         + hint.format(name=name) + "$"):
        _runner(**{name: value})


def test_a_numpy_count_is_taken_as_an_int_and_zero_is_off():
    numpy = pytest.importorskip("numpy")
    assert type(GrowBack(numpy.int64(3), 8).grow_after) is int and GrowBack(0, 8).grow_after is None
    assert CachePolicy(numpy.int64(2)).every_n_steps == 2 and not CachePolicy(0).enabled


def test_fault_times_hint():
    with pytest.raises(ValueError, match=r"^times must be an integer >= 1 or None \(None: every time\), got 0$"):
        FaultInjector((0, "forward"), times=0)
    with pytest.raises(ValueError, match="pass an int, e.g. times=2"):
        FaultInjector((0, "forward"), times=2.0)
