"""The batch-size settings a framework's own code reads, set to a probe trial's size while it runs.

A probe trial runs the user's step at sizes the framework was not set to. Code that reads the
framework's setting instead of the batch it got (a Lightning ``training_step``'s
``torch.randn(self.hparams.batch_size, latent)``, a ``transformers.Trainer`` subclass's
``torch.ones(self.args.per_device_train_batch_size)``) then built tensors of the set size beside a
batch of the trial's, and the probe failed with "The size of tensor a (8) must match the size of
tensor b (2)", where training at the size set runs. Each integration names its places; the
setting is the trial's while it runs, as the framework's own finders set it
(Lightning's ``BatchSizeFinder``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

__all__ = ["sized_for_trial"]


@contextmanager
def sized_for_trial(places: Iterable[tuple[Any, str]], batch_size: int) -> Iterator[None]:
    """Each ``(holder, name)`` (an object's attribute, or a dict's key: an ``hparams`` dict) set to
    ``batch_size`` while the block runs, each put back after it, on error too."""
    saved = [(holder, name, holder[name] if isinstance(holder, dict) else getattr(holder, name))
             for holder, name in places]
    for holder, name, _ in saved:
        _set(holder, name, batch_size)
    try:
        yield
    finally:
        for holder, name, value in saved:
            _set(holder, name, value)


def _set(holder: Any, name: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)
