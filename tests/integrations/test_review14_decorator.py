"""Review 14: ``find_executable_batch_size`` on a function with no positional parameter for the
batch size (``def train(*, batch_size)``): the decorator passes it positionally, as Accelerate's
does, and the first call failed inside its first attempt with Python's "takes 0 positional
arguments but 1 was given", naming neither the decorator nor what to change. It is now one
``TypeError`` where it decorates."""

from __future__ import annotations

import pytest

from autobatch import find_executable_batch_size


def _keyword_only(*, batch_size, model):
    return batch_size, model


def _nothing():
    return None


@pytest.mark.parametrize("function, says", [
    (_keyword_only, "`batch_size` is keyword-only there: move it before the `*`, def _keyword_only(batch_size, ...)"),
    (_nothing, "add it as the first parameter, def _nothing(batch_size, ...)"),
])
def test_a_function_with_no_positional_parameter_for_the_size_is_refused_where_it_is_decorated(function, says):
    with pytest.raises(TypeError, match="passes the batch size to .* as its first positional argument") as caught:
        find_executable_batch_size(function, starting_batch_size=8)
    assert str(caught.value).endswith(says)


def test_forms_that_take_the_size_positionally_still_run():
    forms = [lambda batch_size, *, lr=0.1: batch_size, lambda *sizes: sizes[0], lambda batch_size, /: batch_size]
    assert [find_executable_batch_size(form, starting_batch_size=8)() for form in forms] == [8, 8, 8]
