"""An OOM inside an optimizer's first step leaves half-created state (Adam: ``step`` and
``exp_avg`` but no ``exp_avg_sq``); the next step then raises ``KeyError``, not an OOM. The probe
and the decorator drop what the interrupted step created, so the next try creates it whole."""

import pytest
import torch

import autobatch
from autobatch import find_max_batch, simulated_memory
from autobatch.memory.lazy_state import LazyStateWatch

MiB = 2**20


def _model_and_step(held_per_sample: int = MiB):
    """A plain callable whose loop keeps ``held_per_sample`` bytes a sample through the
    optimizer step (metrics, outputs), so a large batch runs out of memory while Adam (one
    tensor at a time) creates its state, and a small one does not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)

    def step(batch_size: int) -> None:
        model(torch.randn(2, 512)).square().mean().backward()
        held = torch.empty(batch_size * held_per_sample, dtype=torch.uint8)
        optimizer.step()
        optimizer.zero_grad()
        del held

    return model, optimizer, step


def test_without_the_repair_the_next_step_raises_a_key_error():
    with simulated_memory("23MiB"):
        model, optimizer, step = _model_and_step()
        with pytest.raises(torch.OutOfMemoryError):
            step(8)
        partial = [sorted(state) for state in optimizer.state.values()]
        assert any(keys and "exp_avg_sq" not in keys for keys in partial)  # half created
        with pytest.raises(KeyError):
            step(1)


def test_the_watch_drops_only_what_the_interrupted_step_created():
    with simulated_memory("23MiB"):
        model, optimizer, step = _model_and_step()
        watch = LazyStateWatch()
        try:
            step(1)  # a whole first step: complete state for every parameter
            complete = {id(p): sorted(s) for p, s in optimizer.state.items()}
            assert watch.repair() == 0  # no step was running
            optimizer.state.clear()
            with pytest.raises(torch.OutOfMemoryError):
                step(8)
            assert watch.repair() > 0
            assert not optimizer.state  # back to before the step: nothing created
            step(1)
            assert {id(p): sorted(s) for p, s in optimizer.state.items()} == complete
        finally:
            watch.close()


def test_a_plain_callable_whose_first_step_fails_inside_adams_state_is_still_probed():
    with simulated_memory("23MiB"):
        _, optimizer, step = _model_and_step()
        result = find_max_batch(step, strategy="predict", steps_per_trial=2, cache=False)
    assert result.batch_size >= 1
    assert not result.trials[0].passed  # 8 ran out of memory while Adam created its state
    assert all(sorted(state) == ["exp_avg", "exp_avg_sq", "step"] for state in optimizer.state.values())


def test_the_decorator_retries_after_an_oom_inside_adams_first_step():
    with simulated_memory("23MiB"):
        _, _, step = _model_and_step()

        @autobatch.find_executable_batch_size(starting_batch_size=8)
        def train(batch_size: int) -> int:
            step(batch_size)
            return batch_size

        ran = train()
    assert ran < 8 and not train.attempts[0].ok


def test_drop_created_drops_what_the_probe_created_and_keeps_what_was_there_before():
    """State a run had before the probe (a resumed run) stays; what the trials created goes, so
    the next trial's first step creates it, as training's first step does in a new process."""
    model, optimizer, step = _model_and_step()
    first, *rest = list(model.parameters())
    first.grad = torch.zeros_like(first)
    optimizer.step()  # a resumed run: state for every parameter with a gradient (the first)
    resumed = set(optimizer.state)
    assert resumed == {first}
    watch = LazyStateWatch()
    try:
        assert watch.drop_created() == 0  # nothing seen stepping yet
        step(1)
        assert set(optimizer.state) == {first, *rest}
        assert watch.drop_created() == len(rest)
        assert set(optimizer.state) == resumed
        step(1)  # the next step creates it whole again
        assert all(sorted(optimizer.state[p]) == ["exp_avg", "exp_avg_sq", "step"] for p in model.parameters())
    finally:
        watch.close()


def test_growth_counts_state_and_gradients_made_since_as_the_allocator_rounds_them():
    """What an optimizer seen stepping holds afterwards beyond the reading's start, state and
    gradients, each block rounded up to 512 bytes as the caching allocator counts it (a 100-float
    moment is 512 bytes allocated); an optimizer first seen later (a plain callable's own, built
    at each call) is not counted."""
    model = torch.nn.Linear(10, 10)  # weight 400 B, bias 40 B: each a 512-byte block
    optimizer = torch.optim.Adam(model.parameters())
    with LazyStateWatch() as watch:
        optimizer.step()  # seen, no gradients yet: no state
        growth = watch.growth_from_now(torch.device("cpu"))
        model(torch.ones(1, 10)).sum().backward()
        assert growth() == 2 * 512  # two gradients
        optimizer.step()
        assert growth() == 4 * 2 * 512  # and each parameter's two moments and step count (on the CPU here)
        other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1000))], momentum=0.9)
        other.param_groups[0]["params"][0].grad = torch.ones(1000)
        other.step()
        assert growth() == 4 * 2 * 512
        model.zero_grad(set_to_none=True)
        assert growth() == 3 * 2 * 512


def test_a_custom_optimizer_whose_state_is_a_bare_tensor_is_watched_without_raising():
    """A custom optimizer may keep a bare tensor per parameter as its state: the watch's step
    hooks (global: every optimizer in the process) and the growth reading, which runs in a failed
    trial's clean-up, get past it, where its second step raised "Boolean value of Tensor with more
    than one value is ambiguous" inside the hook."""

    class Bare(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for param in group["params"]:
                    self.state[param] = torch.zeros(100)

    model = torch.nn.Linear(10, 10)
    optimizer = Bare(model.parameters())
    with LazyStateWatch() as watch:
        optimizer.step()
        growth = watch.growth_from_now(torch.device("cpu"))
        model(torch.ones(1, 10)).sum().backward()
        assert growth() == 2 * 512
        optimizer.step()  # the hook reads the state the first step made
        assert watch.drop_created() == 2 and not optimizer.state
