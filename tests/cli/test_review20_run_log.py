"""Review 20: a run's log file says how the run ended.

Hydra's ``probe.log``/``train.log`` ended with the last trial or step: a failed job of a sweep
left a ``probe.log`` with nothing in it (the error was on the console and in the summary only),
and an interrupted ``train`` never said it was stopped. The ``autobatch: error:`` line (and the
interrupt's) now goes to the run's log files too, and to the console once, as before.
"""

from __future__ import annotations

import logging

import pytest

from autobatch.cli.errors import CLIError, reported


def test_the_error_line_goes_to_the_runs_log_file_not_twice_to_the_console(tmp_path, capsys):
    handler = logging.FileHandler(tmp_path / "probe.log")
    logging.getLogger().addHandler(handler)
    try:
        with pytest.raises(CLIError) as raised, reported(multirun=True):  # a sweep's job
            raise ValueError("bad width config")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    logged = (tmp_path / "probe.log").read_text()
    assert logged == f"autobatch: error: {raised.value.message}\n" and "ValueError: bad width config" in logged
    assert capsys.readouterr().err == ""  # the console's line is Hydra's (a sweep) or reported()'s (one run), once
