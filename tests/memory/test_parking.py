"""Optimizer state a probe created is laid out as loading a checkpoint places it, or waits out of
the allocator's way until the next step (autobatch.memory.parking). On the CPU the private pool
is stood in for by plain allocation: what is checked is the mechanism (values, identities,
one-shot hook, replaced state, an OOM half-way); the pool itself is checked on a GPU
(tests/gpu/test_cuda_promise.py)."""

import contextlib

import pytest
import torch

import autobatch
from autobatch.memory import parking
from autobatch.memory.lazy_state import LazyStateWatch
from autobatch.probe import promise


def _twins():
    """Two identical models with AdamW, one step taken, so both have state."""
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        optimizer = torch.optim.AdamW(model.parameters())
        out.append((model, optimizer))
    for model, optimizer in out:
        _step(model, optimizer, seed=1)
    return out


def _step(model, optimizer, seed):
    torch.manual_seed(seed)
    model(torch.randn(5, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(optimizer):
    return [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]


def test_parked_state_comes_back_at_the_next_step_and_training_is_unchanged():
    (model, optimizer), (twin, twin_optimizer) = _twins()
    tensors = _state(optimizer)
    ids, values = [id(t) for t in tensors], [t.clone() for t in tensors]
    before = [t.data_ptr() for t in tensors]
    parked = parking.park(optimizer, tensors, contextlib.nullcontext)
    assert parked == sum(t.numel() * t.element_size() for t in tensors)
    assert [t.data_ptr() for t in tensors] != before  # new memory ...
    assert [id(t) for t in _state(optimizer)] == ids  # ... the same tensor objects ...
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))  # ... the same values
    while_parked = [t.data_ptr() for t in tensors]
    for seed in (2, 3, 4):
        _step(model, optimizer, seed)
        _step(twin, twin_optimizer, seed)
    moved_back = [t.data_ptr() for t in tensors]
    assert all(a != b for a, b in zip(moved_back, while_parked))  # copied out at the step
    _step(model, optimizer, 5)
    assert [t.data_ptr() for t in tensors] == moved_back  # once: later steps leave it alone
    _step(twin, twin_optimizer, 5)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)  # bit for bit what training without parking does


def test_a_later_hook_on_the_optimizer_runs_and_a_second_park_reuses_the_hook():
    """torch iterates over an optimizer's pre-hooks: a hook that removed itself there broke the
    step of an optimizer with another hook after it (found on a GPU)."""
    (model, optimizer), _ = _twins()
    parking.park(optimizer, _state(optimizer), contextlib.nullcontext)
    ran = []
    optimizer.register_step_pre_hook(lambda *_: ran.append(1))
    _step(model, optimizer, 2)
    _step(model, optimizer, 3)
    assert ran == [1, 1]
    parking.park(optimizer, _state(optimizer), contextlib.nullcontext)
    assert len(optimizer._optimizer_step_pre_hooks) == 2  # the parking hook, armed again, and the user's
    parked = [t.data_ptr() for t in _state(optimizer)]
    _step(model, optimizer, 4)
    assert all(a != b for a, b in zip(parked, [t.data_ptr() for t in _state(optimizer)]))


def test_state_replaced_before_the_step_is_neither_moved_nor_kept_alive():
    (model, optimizer), (_, other) = _twins()
    parking.park(optimizer, _state(optimizer), contextlib.nullcontext)
    optimizer.load_state_dict(other.state_dict())
    loaded = _state(optimizer)
    hook = parking._HOOKS[optimizer]
    assert all(ref() is None for ref in hook.refs)  # the parked tensors died with the old state
    pointers = [t.data_ptr() for t in loaded]
    optimizer.step()  # no gradients: the step only runs the hook
    assert [t.data_ptr() for t in loaded] == pointers


def test_an_oom_while_parking_stops_there_and_loses_nothing():
    (model, optimizer), _ = _twins()
    tensors = _state(optimizer)
    values = [t.clone() for t in tensors]
    calls = []

    @contextlib.contextmanager
    def into():
        calls.append(1)
        if len(calls) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        yield

    before = [t.data_ptr() for t in tensors]
    parked = parking.park(optimizer, tensors, into)
    assert parked == sum(t.numel() * t.element_size() for t in tensors[:2])
    assert [t.data_ptr() for t in tensors][2:] == before[2:]  # the rest stayed put
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    assert len(parking._HOOKS[optimizer].refs) == 2


def test_state_that_is_a_view_of_a_flat_buffer_stays_put():
    """Some optimizers keep their state as views of one flat buffer: swapping a view's data for
    a copy would part it from the buffer, so such state is never moved (nor a slice of one)."""
    (model, optimizer), _ = _twins()
    flat = torch.zeros(64)
    view, owned = flat[:16].view(4, 4), torch.ones(4)
    parked = parking.park(optimizer, [view, owned, flat[16:32]], contextlib.nullcontext)
    assert parked == owned.numel() * owned.element_size()
    view.add_(1)
    assert flat[:16].eq(1).all()  # still the buffer's


def test_parking_twice_arms_each_tensor_once_and_a_layout_for_good_disarms_it():
    """State parked again is copied back once; state laid out for good before a step
    (relayout_as_loaded) is no longer copied back."""
    (model, optimizer), _ = _twins()
    tensors = _state(optimizer)
    parking.park(optimizer, tensors, contextlib.nullcontext, keep="pool 1")
    parking.park(optimizer, tensors, contextlib.nullcontext, keep="pool 2")
    hook = parking._HOOKS[optimizer]
    assert len(hook.refs) == len(tensors)
    parking._disarm(optimizer, tensors[:2])
    assert [ref() for ref in hook.refs] == tensors[2:] and hook.keep
    parking._disarm(optimizer, tensors[2:])
    assert hook.refs == [] and hook.keep == []


def test_an_error_that_is_not_an_oom_propagates():
    (model, optimizer), _ = _twins()

    @contextlib.contextmanager
    def broken():
        raise RuntimeError("not memory")
        yield

    with pytest.raises(RuntimeError, match="not memory"):
        parking.park(optimizer, _state(optimizer), broken)


def test_where_parking_applies(monkeypatch):
    assert not parking.can_park(torch.device("cpu"))
    (model, optimizer), _ = _twins()
    assert parking.park_until_step(optimizer, _state(optimizer), torch.device("cpu")) == 0
    assert not optimizer._optimizer_step_pre_hooks
    # with expandable segments there is nothing to park (how the setting is read: test_allocator.py)
    monkeypatch.setattr(parking, "expandable_segments", lambda: True)
    assert not parking.can_park(torch.device("cuda", 0))


def test_the_watch_lists_only_state_the_watched_steps_created():
    (model, optimizer), _ = _twins()  # state exists before the watch: a resumed run
    extra = torch.nn.Linear(4, 4)
    optimizer.add_param_group({"params": extra.parameters()})
    with LazyStateWatch() as watch:
        model(torch.randn(5, 8)).sum().add(extra(torch.randn(2, 4)).sum()).backward()
        optimizer.step()
    created = watch.created_on(torch.device("cpu"))
    assert [o for o, _ in created] == [optimizer]
    listed = {id(t) for t in created[0][1]}
    assert listed == {id(t) for p in extra.parameters() for t in optimizer.state[p].values()
                      if t.device.type == "cpu"}
    assert not watch.created_on(torch.device("meta"))


def _plain(model, optimizer):
    def step(batch_size: int) -> None:
        model(torch.randn(batch_size, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def test_laid_out_state_keeps_its_values_and_tensors_and_what_finds_no_room_waits_for_the_step():
    """The moves of relayout_as_loaded: out (the pool), the cache emptied, back in order into new
    memory; a copy back that runs out of memory leaves the rest in the pool until the next step."""
    (model, optimizer), (twin, twin_optimizer) = _twins()
    tensors = _state(optimizer)
    ids, values = [id(t) for t in tensors], [t.clone() for t in tensors]
    events, copies = [], {"n": 0}

    @contextlib.contextmanager
    def into():
        events.append("out")
        yield

    real_move = parking._move

    def move(moving, context):
        if context is contextlib.nullcontext:  # the way back: room for two tensors only
            @contextlib.contextmanager
            def back():
                copies["n"] += 1
                if copies["n"] > 2:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
                yield
            return real_move(moving, back)
        return real_move(moving, context)

    parking._move = move
    try:
        laid = parking.lay_out(optimizer, tensors, into, lambda: events.append("empty"), keep="pool")
    finally:
        parking._move = real_move
    assert events == ["out"] * len(tensors) + ["empty"]
    assert laid == sum(t.numel() * t.element_size() for t in tensors[:2])
    assert [id(t) for t in _state(optimizer)] == ids and all(torch.equal(t, v) for t, v in zip(tensors, values))
    hook = parking._HOOKS[optimizer]
    assert [ref() for ref in hook.refs] == tensors[2:] and hook.keep == ["pool"]  # the rest waits for the step
    for seed in (2, 3):
        _step(model, optimizer, seed)
        _step(twin, twin_optimizer, seed)
    assert hook.refs == [] and hook.keep == []  # came back at the step
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_the_probe_lays_out_what_a_hand_loops_trials_created_and_says_so(monkeypatch):
    """After a plain callable's probe (a hand loop) the state its trials created is laid out as
    its settle trials had it; with hand_loop=False it is parked until the next step instead."""
    seen = {"relayout": [], "park": []}

    def fake(kind):
        def lay(optimizer, tensors, device):
            seen[kind].append((optimizer, list(tensors)))
            return 1234
        return lay

    monkeypatch.setattr(promise, "relayout_as_loaded", fake("relayout"))
    monkeypatch.setattr(promise, "park_until_step", fake("park"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    result = autobatch.find_max_batch(_plain(model, optimizer), memory_limit="8MiB", device="cpu", max_batch=64)
    assert [o for o, _ in seen["relayout"]] == [optimizer] and seen["park"] == []
    every = {id(t) for state in optimizer.state.values() for t in state.values()}  # ``step`` too: it is on the device
    assert {id(t) for t in seen["relayout"][-1][1]} == every
    assert result.promise["laid_out_state_bytes"] == 1234
    assert any("laid out as loading a checkpoint places it" in note for note in result.notes)
    seen["relayout"].clear()
    optimizer = torch.optim.AdamW(model.parameters())  # no state yet: the trials make it
    result = autobatch.find_max_batch(_plain(model, optimizer), memory_limit="8MiB", device="cpu", max_batch=64,
                                      hand_loop=False, cache=False)
    assert seen["relayout"] == []  # no settle trial lays anything out without a hand loop
    assert [o for o, _ in seen["park"]] == [optimizer]
    assert any("private memory pool" in note for note in result.notes)


def test_a_cache_hit_laid_nothing_out_and_does_not_say_it_did(monkeypatch, tmp_path):
    monkeypatch.setattr(promise, "relayout_as_loaded", lambda o, t, d: 1234)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    probe = dict(memory_limit="8MiB", device="cpu", max_batch=64, cache=tmp_path, cache_key="mlp")
    first = autobatch.find_max_batch(_plain(model, optimizer), **probe)
    assert not first.cached and first.promise["laid_out_state_bytes"] == 1234
    hit = autobatch.find_max_batch(_plain(model, optimizer), **probe)
    assert hit.cached and hit.batch_size == first.batch_size
    assert "laid_out_state_bytes" not in hit.promise
    assert not any("laid out as loading" in note for note in hit.notes)


def test_a_train_steps_restore_leaves_nothing_to_lay_out(monkeypatch):
    seen = []
    monkeypatch.setattr(promise, "park_until_step", lambda o, t, d: seen.append(list(t)) or 0)
    monkeypatch.setattr(promise, "relayout_as_loaded", lambda o, t, d: seen.append(list(t)) or 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    step = autobatch.TrainStep(model, optimizer, lambda m, b: m(b).square().mean(), lambda n: torch.randn(n, 8))
    result = autobatch.find_max_batch(step, memory_limit="8MiB", max_batch=64, cache=False)
    assert seen == [] and not optimizer.state  # the snapshot dropped the trials' state
    assert not any("the optimizer state the trials created" in note for note in result.notes)
