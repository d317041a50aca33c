"""``train.min_micro_batch <= train.micro_batch <= train.max_micro_batch`` is checked before
anything runs. Out of order, the runner refused them only after the probe or the plan had run
(minutes on a GPU), in its own argument names (``lower min_micro_batch to at most 2``)."""

from __future__ import annotations

import pytest

from autobatch.cli import preflight
from autobatch.cli.errors import CLIError
from conftest import SMALL


@pytest.mark.parametrize("args, words", [
    (["train.micro_batch=8", "train.max_micro_batch=4"],
     "train.micro_batch=8 is above train.max_micro_batch=4; lower train.micro_batch or raise train.max_micro_batch"),
    (["train.global_batch=8", "train.max_micro_batch=2", "train.min_micro_batch=4"],
     "train.min_micro_batch=4 is above train.max_micro_batch=2"),
    (["train.micro_batch=2", "train.min_micro_batch=4"], "train.min_micro_batch=4 is above train.micro_batch=2"),
])
def test_micro_batch_bounds_out_of_order_are_refused_before_the_run(args, words):
    with pytest.raises(CLIError) as raised:
        preflight.check("train", [*SMALL[:3], *args])
    assert words in raised.value.message and raised.value.exit_code == 2
