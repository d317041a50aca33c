"""Review 24: a model constructor that torch stops with a ``RuntimeError`` for a bad value
(``model=target model._target_=torch.nn.Linear model.in_features=-1``: "Trying to create tensor
with negative dimension") was reported as a failure at run time (exit status 1, a file and
line), where a ``ValueError`` or ``TypeError`` got the "rejected its arguments" bad-input line.
It is bad input now, chained to torch's error (its traceback stays one flag away); out of memory
while building is still raised as it is."""

from __future__ import annotations

import pytest
import torch

from autobatch.cli.construct import construct
from autobatch.cli.errors import BAD_INPUT, describe


def test_a_negative_size_torch_rejects_is_the_bad_input_line():
    with pytest.raises(ValueError) as raised:
        construct("model", {"_target_": "torch.nn.Linear", "in_features": -1, "out_features": 3}, expect=torch.nn.Module)
    message, code = describe(raised.value)
    assert code == BAD_INPUT, message
    assert message.startswith("model: torch.nn.Linear rejected its arguments (RuntimeError: Trying to create tensor "
                              "with negative dimension"), message
    assert isinstance(raised.value.__cause__, RuntimeError)  # AUTOBATCH_TRACEBACK=1 shows torch's frames


class _OutOfMemoryWhenBuilt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_while_building_is_raised_as_it_is():
    with pytest.raises(torch.OutOfMemoryError):
        construct("model", {"_target_": f"{__name__}._OutOfMemoryWhenBuilt"})


class _NegativeWidth(torch.nn.Module):
    """A model of the user's own whose ``__init__`` hands torch a bad size."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, width)


def test_a_bad_size_given_through_the_users_class_names_their_line_too():
    with pytest.raises(ValueError) as raised:
        construct("model", {"_target_": f"{__name__}._NegativeWidth", "width": -2})
    message = str(raised.value)
    assert "rejected its arguments (RuntimeError: Trying to create tensor with negative dimension" in message, message
    assert f"raised at {__file__}:" in message and "in __init__" in message, message
