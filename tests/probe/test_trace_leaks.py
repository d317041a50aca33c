"""Fake tensors never outlive the trace that made them: what the user's code keeps outside the
model's modules while a step is traced with fake tensors (an ``lru_cache`` it calls, a helper
object it holds, a dict at class or module level, a rebound global, a batch memo) is put back
or cleared, so the probe's real trials never compute with a fake, and a fake that still reaches
a step is a clear FakeTensorLeakError, not a wrong answer written to the probe cache."""

import functools
import json
import queue
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import autobatch
from autobatch import find_max_batch
from autobatch.errors import FakeTensorLeakError
from autobatch.probe.tracing.estimate import estimate_max_batch, estimate_memory


@functools.lru_cache(maxsize=8)
def causal_mask(size):
    return torch.triu(torch.full((size, size), float("-inf")), diagonal=1)


class Attention(torch.nn.Module):
    """Reads a mask from an ``lru_cache`` (as many GPT implementations do)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(((q @ k.transpose(-1, -2)) / 4 + causal_mask(x.shape[1])).softmax(-1) @ v)


def _attention_step():
    torch.manual_seed(0)
    model = Attention()
    return autobatch.TrainStep(model, torch.optim.AdamW(model.parameters()), lambda m, b: m(b).pow(2).mean(),
                               lambda n: torch.randn(n, 32, 16))


def test_an_lru_cache_the_forward_calls_is_cleared_and_auto_caches_the_real_answer(tmp_path):
    """The trace used to leave a fake mask in the cache: auto's trials computed with it,
    answered 511 where 340 trains, and cached 511."""
    causal_mask.cache_clear()
    auto = find_max_batch(_attention_step(), device="cpu", memory_limit="8MiB", cache=tmp_path)
    assert type(causal_mask(32)) is torch.Tensor
    causal_mask.cache_clear()
    binary = find_max_batch(_attention_step(), device="cpu", memory_limit="8MiB", strategy="binary", cache=False)
    assert auto.estimate is not None and auto.batch_size == binary.batch_size
    [entry] = tmp_path.glob("*.json")
    assert json.loads(entry.read_text())["result"]["batch_size"] == binary.batch_size
    step = _attention_step()
    estimate_max_batch(step, "8MiB")
    assert type(causal_mask(32)) is torch.Tensor and type(step.model(torch.randn(2, 32, 16))) is torch.Tensor


class Rotary(torch.nn.Module):
    """Keeps a rotary table in a plain helper object, not a buffer."""

    def __init__(self):
        super().__init__()
        self.layer, self.rope = torch.nn.Linear(16, 16), SimpleNamespace(cos=None)

    def forward(self, x):
        if self.rope.cos is None or self.rope.cos.shape[0] != x.shape[1]:
            self.rope.cos = torch.cos(torch.arange(x.shape[1], dtype=torch.float32))[:, None]
        return self.layer(x * self.rope.cos)


def _rotary_step():
    torch.manual_seed(0)
    model = Rotary()
    return autobatch.TrainStep(model, torch.optim.Adam(model.parameters()), lambda m, b: m(b).pow(2).mean(),
                               lambda n: torch.randn(n, 10, 16))


def test_a_helper_objects_attributes_are_put_back_and_auto_matches_binary():
    step = _rotary_step()
    auto = find_max_batch(step, device="cpu", memory_limit="4MiB", cache=False)
    assert step.model.rope.cos is None or type(step.model.rope.cos) is torch.Tensor
    binary = find_max_batch(_rotary_step(), device="cpu", memory_limit="4MiB", strategy="binary", cache=False)
    assert auto.estimate is not None and auto.batch_size == binary.batch_size
    assert type(step.model(torch.randn(2, 10, 16))) is torch.Tensor


MASKS = {}


class SharedCaches(torch.nn.Module):
    """Caches at class level, in a module-level dict and in a rebound global."""

    table = {}

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 16)

    def forward(self, x):
        global LAST_SCALE
        size = x.shape[1]
        if size not in SharedCaches.table:
            SharedCaches.table[size] = torch.ones(size, 1)
        if size not in MASKS:
            MASKS[size] = torch.ones(size, 1)
        LAST_SCALE = SharedCaches.table[size] * MASKS[size]
        return self.layer(x * LAST_SCALE)


def test_class_level_and_module_level_caches_and_rebound_globals_are_put_back():
    model = SharedCaches()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                               lambda n: torch.randn(n, 8, 16))
    estimate_memory(step, 4)
    assert SharedCaches.table == {} and MASKS == {} and "LAST_SCALE" not in globals()
    step(4)
    assert type(SharedCaches.table[8]) is torch.Tensor and type(MASKS[8]) is torch.Tensor
    MASKS.clear(), SharedCaches.table.clear()


@pytest.mark.parametrize("cached", ["dict", "lru_cache"])
def test_a_batch_memo_filled_by_the_cache_keys_fake_batches_is_put_back(tmp_path, cached):
    """The cache key builds make_batch(1) and make_batch(2) under fake tensors: a make_batch
    that memoises small batches kept the fakes, and the trials at 1 and 2 computed with them."""
    memo, seen = {}, queue.SimpleQueue()  # a queue: what the trials' loss saw, never rolled back

    def remember(n):
        if n > 2:
            return torch.randn(n, 8, 16)
        if n not in memo:
            memo[n] = torch.randn(n, 8, 16)
        return memo[n]

    def loss_fn(model, batch):
        seen.put(type(batch))
        return model(batch).pow(2).mean()

    make_batch = remember if cached == "dict" else functools.lru_cache(maxsize=2)(lambda n: torch.randn(n, 8, 16))
    model = SharedCaches()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, make_batch)
    find_max_batch(step, device="cpu", memory_limit="1MiB", strategy="binary", cache=tmp_path)
    assert {seen.get() for _ in range(seen.qsize())} == {torch.Tensor}
    assert all(type(batch) is torch.Tensor for batch in memo.values()) and type(make_batch(2)) is torch.Tensor
    MASKS.clear(), SharedCaches.table.clear()


class Leaky(torch.nn.Module):
    """Holds a fake tensor, as a cache a trace filled where nothing could put it back."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 16)
        self.scale = FakeTensorMode(allow_non_fake_inputs=True).from_tensor(torch.ones(16))  # as the estimate's

    def forward(self, x):
        return self.layer(x * self.scale)


def test_a_step_that_computes_with_a_fake_is_a_clear_error_and_nothing_is_cached(tmp_path):
    model = Leaky()
    weights = [p.detach().clone() for p in model.parameters()]
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                               lambda n: torch.randn(n, 16))
    with pytest.raises(FakeTensorLeakError, match=r"loss_fn returned is a FakeTensor.*strategy='predict' or 'binary'"):
        step(4)
    for strategy in ("auto", "binary"):
        with pytest.raises(FakeTensorLeakError):
            find_max_batch(step, device="cpu", memory_limit="1MiB", strategy=strategy, cache=tmp_path)
    assert not list(tmp_path.glob("*.json"))
    assert all(torch.equal(w, p) and p.grad is None for w, p in zip(weights, model.parameters()))
