"""The library's advice in a warning it logs while ``train`` runs, said as the override to give.

The runner switches a foreach optimizer to ``foreach=False`` when its step does not fit
(:func:`autobatch.probe.foreach.drop_foreach`) and logs "...; build the optimizer with
foreach=False to start so": advice for Python code, which on the command line left the user to
find the key. The library does not import the CLI, so the CLI rewrites the record on the
``autobatch`` logger (before any handler: the console and ``train.log`` alike) to name the
override: ``+optimizer.foreach=false``, or ``optimizer.foreach=false`` where the config already
sets the key (``+`` on an existing key is refused by Hydra). Error notes get the same treatment
in :mod:`autobatch.cli.errors` (``_CLI_ADVICE``).

A resume whose ``train.lr`` or ``optimizer.*`` differs from the checkpoint's logs the runner's
"...; set them after resuming to change them", which the command line cannot do, beside the
run's note that says to start afresh instead (:func:`autobatch.cli.resume_state.kept_settings`):
two lines of contrary advice. The warning's advice is rewritten to the note's, and so is that of
a ``scheduler=target`` schedule's settings replaced ("set them on runner.scheduler in on_step_end").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig

from ..probe.foreach import FOREACH_LOG_ADVICE
from ..training.checkpoints.resume_checks import SCHEDULE_LOG_ADVICE, SETTINGS_LOG_ADVICE

__all__ = ["advice_in_logs"]


#: what a resume from the command line does with the checkpoint's optimizer settings (the run's note says it too)
_SETTINGS_WORDS = "a resumed run keeps them (start afresh without train.resume to train with others)"
#: the same for a ``scheduler=target`` schedule's settings (those of a torch scheduler's state)
_SCHEDULE_WORDS = "start afresh without train.resume to train with this run's"


class _OverrideAdvice(logging.Filter):
    """Rewrites the library's advice in a record's message as the command line's: :data:`FOREACH_LOG_ADVICE`
    as the override, :data:`SETTINGS_LOG_ADVICE` as what a resumed run does."""

    def __init__(self, override: str) -> None:
        super().__init__()
        self.words = {FOREACH_LOG_ADVICE: f"give {override} to start so (the optimizer's key on the command line)",
                      SETTINGS_LOG_ADVICE: _SETTINGS_WORDS, SCHEDULE_LOG_ADVICE: _SCHEDULE_WORDS}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # the advice comes in as an argument of the record
        for advice, words in self.words.items():
            if advice in message:
                record.msg, record.args = message.replace(advice, words), None
                message = record.msg
        return True


@contextmanager
def advice_in_logs(cfg: DictConfig) -> Iterator[None]:
    """While open, the ``autobatch`` logger's foreach advice names ``cfg`` 's override for it, and its
    resumed settings' advice says what the command line does."""
    node = cfg.get("optimizer")
    has_key = node is not None and "foreach" in node.keys()  # a null one too: + would be refused
    advice = _OverrideAdvice("optimizer.foreach=false" if has_key else "+optimizer.foreach=false")
    logger = logging.getLogger("autobatch")
    logger.addFilter(advice)
    try:
        yield
    finally:
        logger.removeFilter(advice)
