"""Review 35, a Hugging Face user with activation checkpointing on a model outside ``PreTrainedModel``.

``train()`` (transformers 5) calls a model's deprecated ``gradient_checkpointing_enable`` with the
``every_n_layers`` and ``offload`` of ``activation_checkpointing_kwargs``; the probe passed neither, so
it checkpointed every layer where ``train()`` checkpoints every second one: it probed less memory
than the run holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from autobatch.integrations.transformers_step import checkpointing_as_train  # noqa: E402


class _OwnModel(torch.nn.Module):
    """A model with only the deprecated switch (sentence-transformers' kind), recording its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.calls.append({"kwargs": gradient_checkpointing_kwargs, "every_n_layers": every_n_layers,
                           "offload": offload})


@pytest.mark.parametrize("settings, expected", [
    ({"every_n_layers": 2, "use_reentrant": False}, {"kwargs": {"use_reentrant": False}, "every_n_layers": 2,
                                                     "offload": False}),
    (None, {"kwargs": None, "every_n_layers": 1, "offload": False}),  # nothing set: transformers 4's call
])
def test_review35_the_probe_switches_checkpointing_on_as_train_does(settings, expected):
    model = _OwnModel()
    args = SimpleNamespace(activation_checkpointing=True, activation_checkpointing_kwargs=settings)
    checkpointing_as_train(SimpleNamespace(args=args, model=model))
    assert model.calls == [expected]
    assert settings is None or settings["every_n_layers"] == 2  # the user's arguments are left as they were
