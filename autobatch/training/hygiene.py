"""Cache hygiene: give the caching allocator's unused blocks back, on a schedule or on need.

The practitioners' remedy for fragmentation is ``empty_cache()`` every N steps, or when
reserved − allocated memory (cached but unused) passes a threshold. Either costs time: the
call synchronises the device and later allocations go back to the driver, so the
:class:`CachePolicy` is off unless asked for and counts how often it fired and how long it
took (the runner reports both; ``scripts/bench_runner.py`` measures the throughput cost).
On the CPU there is no cache: the policy still counts its decisions, the call is a no-op.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from .. import checks
from ..memory.units import parse_bytes

__all__ = ["CachePolicy"]

log = logging.getLogger("autobatch")


class CachePolicy:
    """Decide after each global step whether to empty the allocator cache, and do it.

    ``every_n_steps``: empty it after every N-th step (None or 0: never on a schedule).
    ``slack_threshold``: empty it when reserved − allocated exceeds this many bytes (an int
    or a string like ``"2GiB"``; None: never on need). ``memory`` returns ``(reserved,
    allocated)`` bytes (default: the device's allocator); injectable for tests.
    ``fires`` counts calls, ``seconds`` their total time, ``reasons`` counts them by reason.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        slack_threshold: int | str | None = None,
        *,
        device: torch.device | str = "cpu",
        memory: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        every_n_steps = checks.count("empty_cache_every", every_n_steps, allow_none=True, meaning=" (0 or None: off)")
        self.every_n_steps = every_n_steps or None
        self.slack_threshold = None if slack_threshold is None else parse_bytes(slack_threshold, name="empty_cache_threshold")
        self.device = torch.device(device)
        self.memory = memory or self._allocator_memory
        self.fires = 0
        self.seconds = 0.0
        self.reasons = {"every_n_steps": 0, "slack_threshold": 0}

    @property
    def enabled(self) -> bool:
        return self.every_n_steps is not None or self.slack_threshold is not None

    def after_step(self, steps_done: int) -> bool:
        """Called with the number of global steps done; True when the cache was emptied."""
        if not self.enabled:
            return False
        reason = None
        if self.every_n_steps is not None and steps_done % self.every_n_steps == 0:
            reason = "every_n_steps"
        elif self.slack_threshold is not None:
            reserved, allocated = self.memory()
            if reserved - allocated > self.slack_threshold:
                reason = "slack_threshold"
        if reason is None:
            return False
        began = time.perf_counter()
        self._empty_cache()
        self.seconds += time.perf_counter() - began
        self.fires += 1
        self.reasons[reason] += 1
        log.debug("empty_cache after step %d (%s)", steps_done, reason)
        return True

    def _allocator_memory(self) -> tuple[int, int]:
        if self.device.type == "cpu":
            return 0, 0
        return torch.accelerator.memory_reserved(self.device), torch.accelerator.memory_allocated(self.device)

    def _empty_cache(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.empty_cache()
