"""Check a command line before Hydra runs it, so bad input costs one line, not a traceback.

Hydra reports a misspelt key or a wrong type over several lines, and problems it cannot see
(impossible probe bounds, an unimportable ``_target_``) would only surface inside the job.
:func:`check` composes the config of every job the command line describes (each
combination of a ``-m`` sweep) with Hydra's compose API and runs
:func:`~autobatch.cli.build.validate` on it; the first problem becomes a :class:`CLIError`.
Anything it cannot judge (``--help``, ``--cfg``, sweeper plugins' own syntax) is left to Hydra.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser

from .build import validate
from .conf import CONF_MODULE
from .errors import BAD_INPUT, CLIError, describe

__all__ = ["check", "job_overrides", "MAX_JOBS_CHECKED"]

#: Sweeps larger than this are checked on their first jobs only.
MAX_JOBS_CHECKED = 64
#: Hydra flags after which a check makes no sense (Hydra prints or does something else).
_HANDS_OFF = {
    "-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info", "-p", "--package",
    "--resolve", "-sc", "--shell-completion", "--experimental-rerun", "-cp", "--config-path",
    "-cn", "--config-name", "-cd", "--config-dir",
}  # fmt: skip
_MULTIRUN = {"-m", "--multirun"}


def job_overrides(overrides: Sequence[str], multirun: bool) -> list[list[str]]:
    """The override list of each job: one job, or the product of a sweep's choices."""
    if not multirun:
        return [list(overrides)]
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices: list[list[str]] = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise CLIError(f"{override.input_line}: only discrete sweeps (a,b,c or range()) can be checked")
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            value = override.get_value_element_as_str()
            choices.append([f"{key}={value if value is not None else ''}"])
    return [list(job) for job in itertools.islice(itertools.product(*choices), MAX_JOBS_CHECKED)]


def check(config_name: str, args: Sequence[str]) -> None:
    """Raise :class:`CLIError` (exit 2) naming the first problem in ``args``; else return."""
    if any(arg.split("=", 1)[0] in _HANDS_OFF for arg in args):
        return
    multirun = any(arg in _MULTIRUN for arg in args)
    overrides = [arg for arg in args if arg not in _MULTIRUN]
    unknown = [arg for arg in overrides if arg.startswith("-")]
    if unknown:
        raise CLIError(f"unknown option {unknown[0]!r}; see python -m autobatch {config_name} --help")
    try:
        jobs = job_overrides(overrides, multirun)
        with initialize_config_module(CONF_MODULE, version_base="1.3", job_name=config_name):
            for job in jobs:
                validate(compose(config_name, overrides=job))
    except CLIError:
        raise
    except Exception as exc:  # noqa: BLE001 - turned into one line
        message, _ = describe(exc)
        raise CLIError(message, BAD_INPUT) from exc
