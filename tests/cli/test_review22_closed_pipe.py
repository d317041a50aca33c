"""Review 22: ``python -m autobatch --help | head -3`` ended in a ``BrokenPipeError`` traceback
(so did ``probe --help``, ``--cfg job``, ``cache list`` and ``--version``): output to a pipe whose
reader has gone is now dropped quietly (Python docs, "Note on SIGPIPE")."""

from __future__ import annotations

import io
import sys

import pytest

from autobatch.__main__ import main


class _ReaderGone(io.StringIO):
    """stdout of ``... | head``: the reader has read its lines and closed the pipe."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["cache", "list"]])
def test_a_closed_pipe_ends_the_output_without_a_traceback(args, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ReaderGone())
    assert main(args) == 0  # the command's own status: it ran to the end
    assert capsys.readouterr().err == ""
    assert isinstance(sys.stdout, _ReaderGone)  # put back as it was
