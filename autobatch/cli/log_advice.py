"""The library's advice in a warning it logs while ``train`` runs, said as the override to give.

The runner switches a foreach optimizer to ``foreach=False`` when its step does not fit
(:func:`autobatch.probe.foreach.drop_foreach`) and logs "...; build the optimizer with
foreach=False to start so": advice for Python code, which on the command line left the user to
find the key. The library does not import the CLI, so the CLI rewrites the record on the
``autobatch`` logger (before any handler: the console and ``train.log`` alike) to name the
override: ``+optimizer.foreach=false``, or ``optimizer.foreach=false`` where the config already
sets the key (``+`` on an existing key is refused by Hydra). Error notes get the same treatment
in :mod:`autobatch.cli.errors` (``_CLI_ADVICE``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig

from ..probe.foreach import FOREACH_LOG_ADVICE

__all__ = ["advice_in_logs"]


class _OverrideAdvice(logging.Filter):
    """Rewrites :data:`FOREACH_LOG_ADVICE` in a record's message as the command line's override."""

    def __init__(self, override: str) -> None:
        super().__init__()
        self.words = f"give {override} to start so (the optimizer's key on the command line)"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # the advice comes in as an argument of the record
        if FOREACH_LOG_ADVICE in message:
            record.msg, record.args = message.replace(FOREACH_LOG_ADVICE, self.words), None
        return True


@contextmanager
def advice_in_logs(cfg: DictConfig) -> Iterator[None]:
    """While open, the ``autobatch`` logger's foreach advice names ``cfg`` 's override for it."""
    node = cfg.get("optimizer")
    has_key = node is not None and "foreach" in node.keys()  # a null one too: + would be refused
    advice = _OverrideAdvice("optimizer.foreach=false" if has_key else "+optimizer.foreach=false")
    logger = logging.getLogger("autobatch")
    logger.addFilter(advice)
    try:
        yield
    finally:
        logger.removeFilter(advice)
