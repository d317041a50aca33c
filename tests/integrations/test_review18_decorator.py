"""Review 18: ``find_executable_batch_size`` over a function that catches exceptions itself.

A training function with an ``except Exception`` around its loop (or a per-batch ``except`` that
logs and skips the batch) caught the out-of-memory error before the decorator saw it: the call
returned, the too-large size was recorded as one that ran (``attempt.ok``) and kept as
``wrapped.batch_size`` for the next call, and nothing said that steps had not trained. The device
counts its out-of-memory errors (CUDA's ``num_ooms``, a simulated budget's ``oom_count``), so such
a call is now one ``RuntimeWarning`` saying what to change, and ``attempt.caught_ooms`` counts
them. Errors a nested decorated call handled (it retried them) are not the outer function's.

A plain function that returns a generator (``return loop(batch_size)`` where ``loop`` yields) was
accepted: its steps ran while the caller iterated, after the retry returned, so the out-of-memory
error escaped it and the size was recorded as one that ran. It is refused when called, as a
returned coroutine was.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from autobatch import find_executable_batch_size, simulated_memory

SAMPLE = 64 * 1024  # floats: 256 KiB a sample, 15 fit under 4 MiB


def test_a_function_that_catches_its_out_of_memory_error_is_one_warning_saying_what_to_change():
    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        trained = []
        for _ in range(2):
            try:
                trained.append(torch.zeros(batch_size, SAMPLE).shape[0])
            except Exception:  # noqa: BLE001 - the user's "log and skip the batch"
                continue
        return trained

    with simulated_memory("4MiB"), pytest.warns(RuntimeWarning, match=r"`train` returned at batch 64, but 2 "
                                                r"out-of-memory error\(s\) were raised inside it and caught there.*"
                                                r"is_oom_error\(exc\): raise"):
        assert train() == []  # nothing trained, and the call returned
    assert [(a.batch_size, a.ok, a.caught_ooms) for a in train.attempts] == [(64, True, 2)]


def test_errors_a_nested_decorated_call_handled_are_not_the_outer_functions():
    @find_executable_batch_size(starting_batch_size=64)
    def evaluate(batch_size):
        torch.zeros(batch_size, SAMPLE)
        return batch_size

    @find_executable_batch_size(starting_batch_size=64)
    def skipping(batch_size):
        try:
            torch.zeros(batch_size, SAMPLE)
        except torch.OutOfMemoryError:
            return 0
        return batch_size

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, helper):
        return batch_size, helper()

    with simulated_memory("4MiB"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert train(evaluate) == (8, 15)  # evaluate retried 64 -> 15: nothing was caught by train
    assert [a.caught_ooms for a in train.attempts] == [0]
    with simulated_memory("4MiB"), pytest.warns(RuntimeWarning, match="`skipping` returned at batch 64") as caught:
        assert train(skipping) == (8, 0)
    assert len([w for w in caught if "find_executable_batch_size" in str(w.message)]) == 1  # skipping's, once


async def _async_loop(batch_size):
    yield torch.zeros(batch_size, SAMPLE).shape[0]


def _loop(batch_size):
    for _ in range(2):
        yield torch.zeros(batch_size, SAMPLE).shape[0]


@pytest.mark.parametrize("loop", [_loop, _async_loop])
def test_a_function_that_returns_a_generator_is_refused_when_called(loop):
    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        return loop(batch_size)

    with simulated_memory("4MiB") as device, pytest.raises(TypeError, match=r"`train`: it returned a generator.*"
                                                                         r"return list\(loop\(batch_size\)\)"):
        train()
    assert device.oom_count == 0 and not any(a.ok for a in train.attempts)  # no step ran, no size passed for one


def test_errors_autobatch_handles_inside_the_call_are_not_the_functions():
    """A probe's failed trials and a Runner's replays inside a decorated call are autobatch's own
    handling (``recognised_ooms``): no warning, ``caught_ooms`` 0."""
    from autobatch import FaultInjector, Runner, find_max_batch

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(n):
        model(torch.randn(n, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        found = find_max_batch(step, strategy="binary", max_batch=4096, cache=False).batch_size
        runner = Runner(model, optimizer, lambda m, b: m(b).pow(2).mean(), global_batch=batch_size, micro_batch=batch_size,
                        progress=False, faults=FaultInjector([(0, "forward")]))
        return found, runner.fit([torch.randn(batch_size, 64)]).oom_recoveries

    with simulated_memory("1MiB"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        found, recoveries = train()
    assert found < 4096 and len(recoveries) == 1 and [a.caught_ooms for a in train.attempts] == [0]
