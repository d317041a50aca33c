"""The probe table's notes in the command line's keys: a CPU probe without a limit said "pass
memory_limit to ask about a specific device size", the library's argument, which the command
line spells ``probe.memory_limit``. (``autobatch.planning`` in a message stays as it is.)"""

from __future__ import annotations

import io

from autobatch.cli.display import print_result
from autobatch.cli.errors import cli_keys
from autobatch.probe.result import ProbeResult


def test_the_printed_notes_name_the_command_lines_keys():
    result = ProbeResult(batch_size=8, strategy="binary", strategy_used="binary", trials=[], capacity_bytes=None,
                         elapsed_s=0.1, margin=0.0, device="cpu", notes=["CPU probe with no memory_limit: ...; pass memory_limit to ask about a specific device size"])
    out = io.StringIO()
    print_result(result, file=out)
    assert "note            CPU probe with no probe.memory_limit: ...; pass probe.memory_limit to ask" in out.getvalue()
    assert cli_keys("see autobatch.planning.planner") == "see autobatch.planning.planner"
