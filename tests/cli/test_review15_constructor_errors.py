"""Review 15: a ``_target_`` constructor's own error keeps where it came from.

A ``KeyError`` (``ValueError``, ``TypeError``...) raised inside a user's model or dataset
``__init__`` was reported as "rejected its arguments" with nothing pointing at the user's code,
and ``AUTOBATCH_TRACEBACK=1`` printed only the command line's ``ValueError`` (raised ``from
None``): the user's traceback was gone. Now the line names the file and line that raised it and
the ``ValueError`` is chained to the user's exception. A value torch rejects (``AdamW``'s
``betas``) still names only the override.
"""

from __future__ import annotations

import pytest

from autobatch.cli.construct import construct


class LoadsWeights:
    """A model whose ``__init__`` fails on its own (a missing entry), not on an argument."""

    def __init__(self) -> None:
        raise KeyError("no such weight file: w.bin")


def test_a_constructor_bug_names_the_users_line_and_keeps_its_traceback():
    with pytest.raises(ValueError) as raised:
        construct("model", {"_target_": f"{__name__}.LoadsWeights"})
    message = str(raised.value)
    assert message.startswith("model: ") and "KeyError: 'no such weight file: w.bin'" in message
    assert f"raised at {__file__}:" in message and "in __init__" in message, message
    assert isinstance(raised.value.__cause__, KeyError)  # AUTOBATCH_TRACEBACK=1 shows the user's frames


def test_a_value_torch_rejects_names_no_code_line():
    import torch

    with pytest.raises(ValueError) as raised:
        construct("optimizer", {"_target_": "torch.optim.AdamW", "lr": -1.0}, params=[torch.nn.Parameter(torch.zeros(1))])
    assert "rejected its arguments (ValueError: Invalid learning rate: -1.0)" in str(raised.value)
    assert "raised at" not in str(raised.value)
