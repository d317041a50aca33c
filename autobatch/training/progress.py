"""Training progress: a tqdm bar on a terminal, plain log lines everywhere else.

The bar shows the global step, samples/s, micro-batch x accumulation steps and the OOM
recoveries so far. When stderr is not a terminal (a batch job, CI, a log file) the bar is
off and the same figures go to the ``autobatch`` logger every ``log_every`` steps, so logs
are not flooded with carriage returns. A Jupyter kernel's stderr (ipykernel's ``OutStream``) is
no terminal to ``isatty()``, yet a person watches it: there the bar is on too (``tqdm.auto``
draws a notebook's widget), for the log lines went to a logger a notebook rarely configures, and
a first run showed nothing until it ended.

Its samples/s is the mean over this ``fit()``'s steps so far (the samples since the bar began
over the wall time since then, the first steps' warm-up included), and says so ("mean
samples/s"): the command line's ``metrics.jsonl`` gives each step's own (its samples over its wall
time), which ran 10 % above the log line's figure for the same step and read as a disagreement.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Any

__all__ = ["Progress"]

log = logging.getLogger("autobatch")


def _watched(stream: Any) -> bool:
    """Whether a person watches ``stream``: a terminal, or a Jupyter kernel's output stream."""
    return bool(getattr(stream, "isatty", lambda: False)()) or type(stream).__module__.startswith("ipykernel.")


class Progress:
    """Report training progress. ``bar``: True, False, or None for "when stderr is a TTY or a notebook's"."""

    def __init__(
        self,
        total: int | None,
        *,
        initial: int = 0,
        bar: bool | None = None,
        log_every: int | None = 50,
        file: IO[str] | None = None,
    ) -> None:
        stream = file if file is not None else sys.stderr
        use_bar = bar if bar is not None else _watched(stream)
        self.log_every = log_every or None
        self.bar = None
        if use_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True, leave=True)
        self.total = total
        self._began = time.perf_counter()
        self._samples = 0

    def update(self, step: int, samples: int, micro_batch: int, accumulation: int, recoveries: int, loss: Any) -> None:
        """After a global step: ``step`` is the number of steps done, ``samples`` this step's.
        ``loss`` (a float or a 0-dim tensor) is read only when shown: reading a tensor waits for
        the device, which the runner otherwise never does between steps."""
        self._samples += samples
        rate = self._samples / max(time.perf_counter() - self._began, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix(
                {"mean samples/s": f"{rate:.1f}", "micro": f"{micro_batch}x{accumulation}", "oom": recoveries, "loss": f"{float(loss):.4g}"},
                refresh=False,
            )
            self.bar.update(1)
        elif self.shows(step):
            of = f"/{self.total}" if self.total else ""
            log.info(
                "step %d%s  %.1f samples/s (mean since this fit began)  micro-batch %d x %d  OOM recoveries %d  loss %.4g",
                step, of, rate, micro_batch, accumulation, recoveries, float(loss),
            )

    def shows(self, step: int) -> bool:
        """Whether the report after step ``step`` reads the loss (the bar: every step)."""
        return self.bar is not None or bool(self.log_every and (step % self.log_every == 0 or step == self.total))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
