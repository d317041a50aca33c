"""Probe: the largest batch whose real training step fits, found by trials or estimated.

:func:`find_max_batch` (:mod:`.find`) checks its arguments (:mod:`.arguments`), looks the
answer up in the persistent cache (:mod:`.caching`), runs trials of the user's step
(:mod:`.trial`, :mod:`.train_step`) under a search strategy (:mod:`.searching`), says why the
answer is safe (:mod:`.settling`, :mod:`.fresh_layout`, :mod:`.promise`) and puts the model back
(:mod:`.snapshot`); or estimates the answer with fake tensors without touching the device
(:mod:`.tracing`). Across ranks it agrees through :mod:`.ranks`.
"""

from .arguments import ALLOCATOR_HEADROOM, SEARCH_CEILING, STRATEGY_NAMES
from .find import find_max_batch

__all__ = ["find_max_batch", "ALLOCATOR_HEADROOM", "SEARCH_CEILING", "STRATEGY_NAMES"]
