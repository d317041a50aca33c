"""The size that made the state a probe holds, after a check in a new process's layout dropped it
and made it again (issue 16: a VAE's ``TrainStep`` on an H200 answered 1216 where 1522 trains,
its confirmations failing at the wall beside state made at 1536 while the probe remembered 8)."""

import torch

from autobatch.memory.lazy_state import LazyStateWatch
from autobatch.probe.pinned_state import PinnedState


def _step(model, optimizer):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_state_made_again_after_a_drop_is_remembered_at_the_size_that_made_it():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    with LazyStateWatch() as watch:
        pinned = PinnedState(watch)
        _step(model, optimizer)
        pinned.observe(8)  # the first trial made it
        assert pinned.made_at == 8
        watch.drop_created()  # the check in a new process's layout drops it ...
        _step(model, optimizer)
        pinned.observe(1536)  # ... and its first step makes it again, at its own size
        assert pinned.made_at == 1536
        pinned.observe(1535)  # kept: made at 1536, not again since
        assert pinned.made_at == 1536
        assert pinned.drop_if_pinning(1535) and not optimizer.state


def test_a_drop_that_made_nothing_again_forgets_the_size():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    with LazyStateWatch() as watch:
        pinned = PinnedState(watch)
        _step(model, optimizer)
        pinned.observe(8)
        watch.drop_created()
        pinned.observe(1536)  # its first step ran out of memory: no state made
        assert pinned.made_at is None
