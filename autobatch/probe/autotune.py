"""cuDNN autotuning during a probe: off for the search, on for the answer's confirmation.

With ``torch.backends.cudnn.benchmark = True`` cuDNN times every candidate algorithm the first
time it sees a convolution shape, and every search trial is a new shape: a ResNet-50 trial
took ~3.7 s instead of ~0.3 s on an H200 (issue 16). Which size fits does not need the
fastest algorithm, only *an* algorithm: so search trials run with autotuning off (cuDNN's
heuristics pick one). The autotuner's choice does change memory (it picks among the
algorithms whose workspace fits the memory free at that moment, so it fills memory to the
brim, and a workspace that fits only after the allocator returns its cache makes every step
flush it), so the answer's confirming trial runs with the user's setting on, as training will.

**The search must not decide what training runs.** PyTorch caches one cuDNN plan per
convolution key (shapes, dtype, layout, ``deterministic``, ``allow_tf32``), and
``benchmark`` is not part of the key: a shape first run untuned keeps its heuristic plan when
autotuning is switched on later. Measured on an H200 (ResNet-50, 8 GiB cap,
``scripts/diag_cudnn_cache.py``): after three untuned steps at 160, switching autotuning on cost
0.07 s at the next step (a cache hit, no autotuning) against 3.3-4.3 s where the untuned steps
had run under another key. So a probe that searched under the user's key confirmed its answer
with heuristic plans, and training in that process never autotuned at the answer's shapes,
while a new process autotuned plans the probe never measured (ResNet-50 at the answer, a hand
loop: out of memory at steps 5-25 in 4 of 6 new processes, the allocator flushing its cache at
every step). Search trials therefore run with ``cudnn.deterministic`` flipped, a key training
never uses: same heuristics less the nondeterministic engines, and the same allocated peak in
that measurement (7.0178 GiB bf16, 6.8171 GiB fp32; flipping ``allow_tf32`` instead moved the
fp32 peak to 7.34 GiB). The confirmation runs under the user's own flags, autotunes for real,
and leaves its plans cached for training. Both flags are put back exactly when the probe
ends, whatever happens. cuDNN operators other than convolutions that read the flag (RNNs,
CTC loss) run under the flipped setting in untuned trials too; the confirmation measures the
answer under the user's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["Autotune"]


class Autotune:
    """The user's cuDNN flags and where trials may autotune.

    ``wanted``: the user asked for autotuning and the probe runs on CUDA. :meth:`trial` sets
    the flags for one trial (``tuned``: a confirming trial, run as training will run, under the
    user's flags; otherwise autotuning off under a plan-cache key training never uses);
    :meth:`restore` puts the user's values back.
    """

    def __init__(self, device: torch.device) -> None:
        self.original = torch.backends.cudnn.benchmark
        self.deterministic = torch.backends.cudnn.deterministic
        self.wanted = bool(self.original) and device.type == "cuda"

    @contextmanager
    def trial(self, tuned: bool) -> Iterator[None]:
        if not self.wanted:
            yield
            return
        torch.backends.cudnn.benchmark = tuned
        # an untuned trial's heuristic plans are cached under the flipped key, not the user's
        torch.backends.cudnn.deterministic = self.deterministic if tuned else not self.deterministic
        try:
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        torch.backends.cudnn.benchmark = self.original
        torch.backends.cudnn.deterministic = self.deterministic
