"""What the decorator hands back does not keep the user's model alive (review 38).

``find_executable_batch_size``'s wrapper named itself in its own closure (a cycle), so the user's
function, and the model and optimizer it closes over (built in ``main()``, the Accelerate pattern),
outlived ``main()`` until the garbage collector's next full collection. The Lightning callback's
test is in test_review38_lightning_freed.py (Lightning is imported at collection there)."""

from __future__ import annotations

import gc
import weakref

import torch

from autobatch import find_executable_batch_size


def _main() -> tuple[weakref.ref, weakref.ref]:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size):
        model(torch.randn(batch_size, 4)).sum().backward()
        optimizer.step()
        return batch_size

    assert train() == 4 and train.batch_size == 4 and [a.ok for a in train.attempts] == [True]
    return weakref.ref(model), weakref.ref(train)


def test_review38_a_decorated_function_and_what_it_closes_over_are_freed_when_dropped():
    enabled = gc.isenabled()
    gc.disable()  # a collection in between would hide the cycle
    try:
        model, train = _main()
        assert train() is None and model() is None
    finally:
        if enabled:
            gc.enable()

