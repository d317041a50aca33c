"""``AccumulationBrokenError`` (review 25): the Runner raises it where ``loss_fn`` zeroes the
gradients or steps a scheduler between a micro-batch's forward and backward, but it lived in
``autobatch.training.grad_watch`` alone, unlike every other error of the library: not in
``autobatch.errors``, not exported from ``autobatch`` nor in the API reference, so
``except autobatch.AccumulationBrokenError`` failed with ``AttributeError``."""

from __future__ import annotations

import autobatch
from autobatch import errors
from autobatch.training import grad_watch


def test_accumulation_broken_error_is_one_of_the_librarys_errors():
    assert "AccumulationBrokenError" in autobatch.__all__ and "AccumulationBrokenError" in errors.__all__
    assert autobatch.AccumulationBrokenError is errors.AccumulationBrokenError is grad_watch.AccumulationBrokenError
    assert issubclass(autobatch.AccumulationBrokenError, RuntimeError)
