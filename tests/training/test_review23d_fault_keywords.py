"""``inject_oom(runner, at_step=3)`` and ``FaultInjector(step=2, count=2)``, the names users reach
for, were Python's bare "unexpected keyword argument": one ``TypeError`` naming ``at`` (the
(step, phase) pairs) or ``times``, as every other public entry point does."""

from __future__ import annotations

import pytest

from autobatch import FaultInjector, inject_oom


@pytest.mark.parametrize("call, meant", [
    (lambda: inject_oom(object(), at_step=3), "'at_step'; did you mean 'at'?"),
    (lambda: FaultInjector(step=2), "'step'; did you mean 'at'?"),
    (lambda: FaultInjector([(1, "forward")], count=2), "'count'; did you mean 'times'?"),
])
def test_a_fault_keyword_of_another_name_is_told_the_one_to_use(call, meant):
    with pytest.raises(TypeError, match=meant):
        call()


def test_the_injectors_own_keywords_still_work():
    injector = FaultInjector(at=[(1, "forward")], times=2)
    assert injector.points == {(1, "forward")} and injector.times == 2
