"""cuDNN autotuning during a probe: off for the search, on for the answer's confirmation.

With ``torch.backends.cudnn.benchmark = True`` cuDNN times every candidate algorithm the first
time it sees a convolution shape, and every search trial is a new shape: a ResNet-50 trial
took ~3.7 s instead of ~0.3 s on an H200 (issue 16). Which size fits does not need the
fastest algorithm, only *an* algorithm: so search trials run with autotuning off (cuDNN's
heuristics pick one, with a modest workspace). The autotuner's choice does change memory
(a faster algorithm may want a larger workspace, and it picks among those that fit the memory
free at that moment), so the answer's confirming trial runs with the user's setting on, as
training will: the answer is known to train with the algorithms training will use. The
user's setting is put back exactly when the probe ends, whatever happens.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["Autotune"]


class Autotune:
    """The user's ``cudnn.benchmark`` setting and where trials may autotune.

    ``wanted``: the user asked for autotuning and the probe runs on CUDA. :meth:`trial` sets
    the flag for one trial (``tuned``: a confirming trial, run as training will run);
    :meth:`restore` puts the user's value back.
    """

    def __init__(self, device: torch.device) -> None:
        self.original = torch.backends.cudnn.benchmark
        self.wanted = bool(self.original) and device.type == "cuda"

    @contextmanager
    def trial(self, tuned: bool) -> Iterator[None]:
        if not self.wanted:
            yield
            return
        torch.backends.cudnn.benchmark = tuned
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = self.original

    def restore(self) -> None:
        torch.backends.cudnn.benchmark = self.original
