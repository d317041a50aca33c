"""autobatch.find_executable_batch_size: Accelerate's call forms, plus measured shrinking."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import autobatch
from autobatch import NoBatchFitsError, find_executable_batch_size, simulated_memory

PER_SAMPLE = 64 * 1024  # bytes of activations per sample in the toy step below


def step(batch_size: int, width: int = PER_SAMPLE // 4) -> int:
    """A toy step whose peak is ~batch_size * PER_SAMPLE (float32 activations kept alive)."""
    activations = [torch.ones(batch_size, width // 4) for _ in range(4)]
    return sum(a.shape[0] for a in activations) // 4


def test_both_call_forms_forward_arguments():
    @find_executable_batch_size
    def bare(batch_size, a, *, b=0):
        return batch_size, a, b

    @find_executable_batch_size(starting_batch_size=16)
    def called(batch_size, a, *, b=0):
        return batch_size, a, b

    assert bare(1, b=2) == (128, 1, 2)
    assert called("x", b=3) == (16, "x", 3)
    assert [a.batch_size for a in called.attempts] == [16] and called.attempts[0].ok


def test_passing_the_batch_size_is_a_type_error():
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match="Batch size was passed") as raised:
        train(8, torch.optim.Adam(torch.nn.Linear(4, 4).parameters()))
    assert "\n" not in str(raised.value) and "`train(model)`" in str(raised.value)  # one line: names, not reprs


def test_review38_a_function_without_a_batch_size_parameter_is_told_to_add_it():
    """``def train(model, optimizer)`` called ``train(model, optimizer)``: the error said the batch size
    was passed and to call ``train(optimizer)``, which gave the size to ``model`` ('int' object is not callable)."""
    model = torch.nn.Linear(4, 4)

    @find_executable_batch_size(starting_batch_size=8)
    def train(model, optimizer):
        return model

    class Loop:
        @find_executable_batch_size(starting_batch_size=8)
        def fit(self, model):
            return model

    with pytest.raises(TypeError, match=r"its first argument is a Linear, not a batch size: add the batch size as "
                                        r"`train`'s first parameter, def train\(batch_size, model, optimizer\)") as raised:
        train(model, None)
    assert "\n" not in str(raised.value) and "Remove it" not in str(raised.value)
    with pytest.raises(TypeError, match=r"def fit\(self, batch_size, model\), and keep the call as it is"):
        Loop().fit(model)
    with pytest.raises(TypeError, match=r"Batch size was passed into `train` .* `train\(optimizer\)`"):
        train(torch.tensor(8), None)  # a size, an integer tensor too, is still the caller's to remove


def test_a_generator_is_refused_where_it_is_decorated():
    """A generator's steps run while the caller iterates, after the wrapper returned: an OOM there
    would escape the retry, and the record would say a size ran that did not."""
    with pytest.raises(TypeError, match="cannot retry the generator `train`"):
        @find_executable_batch_size(starting_batch_size=8)
        def train(batch_size):
            yield batch_size


def test_non_oom_errors_propagate_unchanged():
    calls = []

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        calls.append(batch_size)
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        broken()
    assert calls == [8]


def test_shrinks_from_the_measured_peak_in_one_jump():
    """Budget for ~100 samples; starting at 400, ×0.9 would need 14 failures, the measured
    lower bound gets there in a few and the answer is within a few % of the largest fit."""
    fits = {}

    @find_executable_batch_size(starting_batch_size=400)
    def train(batch_size):
        step(batch_size)
        return batch_size

    with simulated_memory(100 * PER_SAMPLE + PER_SAMPLE // 2):
        found = train()
    failed = [a for a in train.attempts if not a.ok]
    assert 1 <= len(failed) <= 4
    assert failed[0].next_from == "measured" and failed[0].peak_bytes is not None
    assert 90 <= found <= 100 and train.batch_size == found
    assert train.attempts[-1].ok and train.attempts[-1].peak_bytes is not None  # the passing one's too


def test_fallback_without_instruments_is_accelerates_factor():
    @find_executable_batch_size(starting_batch_size=100)
    def train(batch_size):
        if batch_size > 80:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    assert train() == 72  # 100 -> 90 -> 81 -> 72
    assert [a.next_from for a in train.attempts[:-1]] == ["fallback"] * 3
    assert train.attempts[0].requested_bytes == 2 * 1024**3
    assert train() == 72 and train.attempts[-1].batch_size == 72  # a later call starts where it ran


def test_reduce_batch_size_fn_is_honoured():
    sizes = iter([10, 3])

    @find_executable_batch_size(starting_batch_size=50, reduce_batch_size_fn=lambda: next(sizes))
    def train(batch_size):
        if batch_size > 5:
            raise torch.OutOfMemoryError("out of memory")
        return batch_size

    assert train() == 3


def test_batch_one_failing_is_a_clear_error():
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(NoBatchFitsError, match="batch 1") as info:
        train()
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert [a.batch_size for a in train.attempts] == [4, 3, 2, 1]


def test_failed_attempt_memory_is_released_before_the_next_one():
    """The failed call's frames (and its tensors) are gone when the next attempt starts."""
    alive = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        held = torch.ones(batch_size, 1024)
        alive.append(weakref.ref(held))
        if batch_size == 8:
            raise torch.OutOfMemoryError("out of memory")
        gc.disable()
        try:
            return [ref() is None for ref in alive[:-1]]
        finally:
            gc.enable()

    assert train() == [True]


VOCAB, SEQ = 8192, 32


def _fresh_model_step(batch_size: int) -> None:
    """Accelerate's pattern: model and optimizer built inside the call, two AdamW steps."""
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        x = torch.randint(0, VOCAB, (batch_size, SEQ))
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_model_built_in_each_call_is_let_go_with_its_attempt():
    """Each failed attempt's model, gradients and AdamW moments are freed before the next: every
    attempt starts from empty memory and the search ends at the largest size that trains, where
    optimizers held by the step watch kept them all and the search fell to batch 1."""

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        _fresh_model_step(batch_size)
        return batch_size

    with simulated_memory("40MiB"):
        found = train()
        assert all(a.start_bytes == 0 for a in train.attempts)
        largest = max(b for b in range(found, found + 3) if _fits(b))
    assert found == largest


def _fits(batch_size: int) -> bool:
    try:
        _fresh_model_step(batch_size)
    except torch.OutOfMemoryError:
        return False
    return True


def test_the_bound_is_what_was_allocated_at_the_failure_not_an_earlier_peak():
    """An attempt whose peak came early and was freed bounds its need by what was allocated when
    the later allocation failed: 120 needs 108 MiB of a 100 MiB budget, so 110 is next (the bound
    allows more than ×0.9: the call's one finer step, ×0.95, capped by the bound), not the 58 that
    the early peak plus the failed allocation said."""
    mib = 2**20

    @find_executable_batch_size(starting_batch_size=120)
    def work(batch_size):
        early = torch.ones(int(0.8 * batch_size * mib), dtype=torch.uint8)
        del early
        late = torch.ones(int(0.9 * batch_size * mib), dtype=torch.uint8)
        return late.numel() // mib

    with simulated_memory("100MiB"):
        work()
    assert [a.batch_size for a in work.attempts] == [120, 110] and work.attempts[0].failed_at_bytes == 0
    assert work.attempts[0].next_from == "finer"


def test_bad_arguments():
    with pytest.raises(ValueError, match="starting_batch_size"):
        find_executable_batch_size(lambda b: b, starting_batch_size=0)
    with pytest.raises(ValueError, match="fallback_factor"):
        find_executable_batch_size(lambda b: b, fallback_factor=1.5)


def test_exported_at_top_level():
    assert "find_executable_batch_size" in autobatch.__all__


@pytest.mark.parametrize("raised", [KeyboardInterrupt("stopped"), ValueError("bad sample")], ids=["ctrl-c", "error"])
def test_review34_an_interrupted_attempt_is_not_a_size_that_ran(raised):
    """Ctrl-C during the retry at 115 (after 128 ran out of memory), or a ``ValueError`` (not out of
    memory) raised there, left 115, untested, as the size the next call started from, and its attempt
    read as a failure with no error. Now the exception is re-raised as it was (an error with the
    retry's note), the attempt says ``interrupted``, and the next call starts at 128 again, unless the
    attempt stepped an optimizer (its steps ran at 115: a run resumed from its checkpoint skips its
    batches at that size)."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, fail=False, steps=False):
        sizes.append(batch_size)
        if fail and batch_size < 128:
            if steps:
                model(torch.ones(batch_size, 2)).sum().backward()
                optimizer.step()
            raise raised
        if batch_size > 100:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return batch_size

    for steps, starts_at in ((False, 128), (True, 115)):
        with pytest.raises(type(raised)) as info:
            train(fail=True, steps=steps)
        notes = " ".join(getattr(raised, "__notes__", None) or ())
        assert info.value is raised and (("ran out of memory" in notes) if isinstance(raised, Exception) else not notes)
        last = train.attempts[-1]
        assert (last.batch_size, last.ok, last.interrupted, last.error) == (115, False, True, None)
        assert train.attempts[-2].error and not train.attempts[-2].interrupted and train.batch_size == starts_at
        sizes.clear()
        assert train() == 92 and sizes[0] == starts_at
        train.batch_size = 128
