"""Lightning's ``BatchSizeFinder`` as :class:`~autobatch.integrations.lightning.AutoBatchSize` speaks it:
its argument names (``mode``, ``init_val``, ``max_trials``, ``max_val``) mapped to
:func:`~autobatch.find_max_batch`'s options (:func:`finder_options`), and where it reads the batch
size (:func:`current_batch_size`). Why: a user migrating from ``BatchSizeFinder(mode="binsearch",
init_val=32, max_trials=10)`` by renaming the class got Python's bare "unexpected keyword argument
'mode'". Split from :mod:`.lightning` to keep each module readable.

How each maps, and why:

* ``mode="power"`` is ``strategy="power"`` (the largest power-of-two multiple of the start that
  passes, as Lightning answers), ``mode="binsearch"`` is ``strategy="binary"`` (double, then bisect
  to the exact boundary); any other mode is one ``ValueError``. A ``mode`` given is always honoured,
  ``"power"`` too (Lightning's default): it names the search and its answers (powers of two), which
  a user may rely on. Leave ``mode`` out for autobatch's default (``auto``: the exact boundary in
  fewer trials).
* ``init_val`` is the probe's ``start``, except Lightning's default ``init_val=2``, which is taken as
  not given: it is what ``BatchSizeFinder`` does when it is left out, and forcing it would make
  autobatch's own start worse (``predict``, the default, starts at 8, where a step's peak is not
  distorted by what does not grow with the batch; ``halving`` at 1024 would stop at 2); for
  ``power`` and ``binary`` the default start is 1, whose answers are the same powers of two. To start
  at 2, pass ``probe_options={"start": 2}``.
* ``max_trials`` has no counterpart (``find_max_batch`` caps sizes, not trials). In Lightning it
  bounds the doublings: measured with Lightning 2.6 on the CPU (no OOM), ``mode="power"`` with
  ``init_val=2, max_trials=3`` answered 8, ``init_val=3, max_trials=4`` answered 24, and
  ``max_trials=1`` answered ``init_val``: the largest size tried is ``init_val * 2 ** (max_trials - 1)``
  (``binsearch`` the same, less its 5 % margin). That cap is what a migrating user expects, so it is
  ``max_batch`` (the lower of the two where ``max_batch`` is given too), from ``init_val``, else
  the ``start`` in ``probe_options``, else Lightning's default 2. A cap at or above the search
  ceiling (:data:`autobatch.probe.arguments.SEARCH_CEILING`; Lightning's default ``max_trials=25``
  is one) sets none: the ceiling stops the search first, and a ``max_batch`` would lift it.
* ``max_val`` (``BatchSizeFinder``'s largest size, default 8192) is ``max_batch``.

The same option given twice with different values (``mode`` and a ``strategy`` other than ``auto``;
``init_val`` and ``probe_options["start"]``; ``max_val`` and ``max_batch``) is one ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.parsing import lightning_getattr

from ..probe.arguments import SEARCH_CEILING, STRATEGY_NAMES
from .. import checks

__all__ = ["MODES", "LIGHTNING_INIT_VAL", "finder_options", "current_batch_size"]

#: ``BatchSizeFinder``'s modes and the strategy each is.
MODES = {"power": "power", "binsearch": "binary"}
#: ``BatchSizeFinder``'s default ``init_val``: taken as not given (see the module's docstring).
LIGHTNING_INIT_VAL = 2


def finder_options(given: dict[str, Any], extra: Mapping[str, Any] | None, *, mode: str | None = None,
                   init_val: int | None = None, max_trials: int | None = None,
                   max_val: int | None = None) -> tuple[dict[str, Any], Mapping[str, Any] | None]:
    """``AutoBatchSize``'s own probe options and its ``probe_options``, with ``BatchSizeFinder``'s
    arguments mapped into them (see the module's docstring); for :func:`.lightning_options.checked_probe_options`."""
    given, start = dict(given), extra.get("start") if isinstance(extra, Mapping) else None
    if mode is not None:
        strategy = MODES.get(mode.lower()) if isinstance(mode, str) else None
        if strategy is None:
            named = isinstance(mode, str) and mode in STRATEGY_NAMES  # autobatch's name given as Lightning's
            raise ValueError(f"AutoBatchSize: mode must be 'power' or 'binsearch' (Lightning's BatchSizeFinder modes), "
                             f"got {mode!r}; " + (f"for autobatch's strategy pass strategy={mode!r}" if named else
                                                  f"or leave mode out and pass strategy=, one of {', '.join(STRATEGY_NAMES)}"))
        if given["strategy"] not in ("auto", strategy):
            raise ValueError(f"AutoBatchSize: mode={mode!r} is strategy={strategy!r}, and strategy="
                             f"{given['strategy']!r} was given too; pass one of them")
        given["strategy"] = strategy
    if max_val is not None:
        max_val = checks.positive_int("max_val", max_val)
        if given["max_batch"] not in (None, max_val):
            raise ValueError(f"AutoBatchSize: max_val={max_val} (Lightning's name for max_batch) and max_batch="
                             f"{given['max_batch']} disagree; pass one of them")
        given["max_batch"] = max_val
    if init_val is not None:
        init_val = checks.positive_int("init_val", init_val)
        if start is not None and start != init_val:
            raise ValueError(f"AutoBatchSize: init_val={init_val} (Lightning's name for the probe's start) and "
                             f"probe_options['start']={start!r} disagree; pass one of them")
        if init_val != LIGHTNING_INIT_VAL and (extra is None or isinstance(extra, Mapping)):
            start, extra = init_val, {**(extra or {}), "start": init_val}
    if max_trials is not None:
        max_trials = checks.positive_int("max_trials", max_trials)
        base = start if isinstance(start, int) and start >= 1 else LIGHTNING_INIT_VAL
        cap = base * 2 ** (max_trials - 1)  # the largest size BatchSizeFinder tries
        if cap < given["multiple_of"]:
            raise ValueError(f"AutoBatchSize: max_trials={max_trials} from a start of {base} tries sizes up to {cap}, "
                             f"below multiple_of={given['multiple_of']}: raise max_trials or lower multiple_of")
        if cap < SEARCH_CEILING:
            given["max_batch"] = cap if given["max_batch"] is None else min(cap, given["max_batch"])
    return given, extra


def current_batch_size(module: LightningModule, name: str = "batch_size") -> Any:
    """The batch size where ``BatchSizeFinder`` reads it (``lightning_getattr``)."""
    return lightning_getattr(module, name)
