"""Review 20b: hand loops under ``find_executable_batch_size``, as their users write them.

* ``def train(model, batch_size)``: the size went to ``model``, the caller's model to
  ``batch_size``, and the first attempt failed far from the cause; now one ``TypeError`` where it
  decorates, saying to make ``batch_size`` the first parameter.
* An optimizer made inside the function over a model made outside died with the failed
  attempt's frames before the gradients were dropped, so its model's gradients stayed and the
  retry's first step applied the sum of two backward passes.
* A ``OneCycleLR`` made outside stepped on through a failed attempt's steps, and the retry raised
  torch's "Tried to step 41 times" with nothing naming the retry; now a note does.
* A method that reads ``self.batch_size`` ignores its size: the error names it.
"""

from __future__ import annotations

import pytest
import torch

from autobatch import NoBatchFitsError, find_executable_batch_size, simulated_memory


def _after_model(model, batch_size):
    return batch_size


def _keyword_only_after_model(model, *, batch_size):
    return batch_size


class _Trainer:
    def fit(self, model, batch_size):
        return batch_size


@pytest.mark.parametrize("function, fix", [
    (_after_model, "def _after_model(batch_size, model)"),
    (_keyword_only_after_model, "def _keyword_only_after_model(batch_size, model)"),
    (_Trainer.fit, "def fit(self, batch_size, model)"),
])
def test_a_batch_size_parameter_that_is_not_first_is_refused_where_it_is_decorated(function, fix):
    with pytest.raises(TypeError, match="names `model`, not `batch_size`") as caught:
        find_executable_batch_size(function, starting_batch_size=8)
    assert str(caught.value).endswith(f"Make batch_size the first parameter, {fix}")


def test_an_optimizer_made_inside_over_a_model_made_outside_leaves_no_gradient_to_the_retry():
    model = torch.nn.Linear(64, 64)
    seen = []

    @find_executable_batch_size(starting_batch_size=256)
    def train(batch_size):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen.append(model.weight.grad)
        model(torch.randn(batch_size, 64)).sum().backward()
        torch.empty(batch_size * 1024)  # a buffer after backward: too large at 256
        optimizer.step()
        optimizer.zero_grad()
        return batch_size

    with simulated_memory("1MiB"):
        assert train() < 256
    assert seen[0] is None and all(grad is None for grad in seen[1:])  # the failed backward's was summed in


def test_an_error_a_retry_raises_names_the_failed_attempts_and_their_steps():
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        for step in range(10):
            if step == 6 and batch_size > 4:  # a long batch late in the epoch
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            model(torch.randn(batch_size, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()

    with pytest.raises(ValueError, match="Tried to step") as caught:
        train()
    note = " ".join(getattr(caught.value, "__notes__", []))
    assert "retry of `train` at batch 7 raised this, after 1 attempt(s) ran out of memory (batch 8)" in note
    assert "they took 6 optimizer step(s)" in note and "make the optimizer, scheduler" in note


def test_a_method_that_reads_self_batch_size_is_told_so():
    class Trainer:
        batch_size = 4096

        @find_executable_batch_size(starting_batch_size=64)
        def fit(self, batch_size):
            return torch.ones(self.batch_size * 64).sum()  # ignores the size it is given

    with simulated_memory("512KiB"), pytest.raises(NoBatchFitsError, match="`self.batch_size` is 4096"):
        Trainer().fit()
