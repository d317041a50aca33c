"""Review 14: the command line's one-line error keeps its advice.

* A message over 600 characters (an ``EstimateError`` naming a long untraceable operator and what
  the trace left) was cut at its end, where the library says what to change; now its middle goes.
* The estimate's advice names the library's arguments (``strategy='binary'``, ``estimate_first``,
  which the command line has no key for); it reads as the command line's ``probe.strategy=binary``.
"""

from __future__ import annotations

from autobatch.cli.errors import cli_keys, one_line
from autobatch.probe.tracing.estimate import TRIALS


def test_a_long_message_keeps_its_start_and_its_advice():
    text = one_line(ValueError("could not trace the step: " + "x" * 900 + "; set probe.multiple_of=2"))
    assert len(text) <= 600 and text.startswith("could not trace the step: ") and text.endswith("set probe.multiple_of=2")
    assert " ... " in text


def test_the_estimates_advice_names_the_command_lines_key():
    said = cli_keys(f"could not trace the step with fake tensors: aten.nonzero; {TRIALS}")
    assert said.endswith("probe with real trials (probe.strategy=binary)") and "estimate_first" not in said
