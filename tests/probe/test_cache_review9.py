"""The probe cache, reviewed: false hits (a nested or long ``cache_key``, the parameters an
optimizer trains, the attention backends, parameter hooks, an optimizer class of the same
name), a false miss (a NumPy array's random values), a hand-edited entry that crashed the
hit, and entries other users of a shared cache could not read (CPU)."""

import json
import logging
import os
import stat

import numpy as np
import pytest
import torch

import autobatch
from autobatch import cache as probe_cache
from autobatch import find_max_batch

from workloads import ThresholdStep, make_mlp_step


def _key(step, cache_key=None) -> str:
    return probe_cache.key_of(
        probe_cache.key_components(step, cache_key=cache_key, device="cpu", capacity=2**30, memory_limit=None, probe={})
    )


# -- a user's cache_key ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "one, other",
    [
        ({"model": {"enc": {"layer": {"width": 512}}}}, {"model": {"enc": {"layer": {"width": 1024}}}}),
        ({f"k{i}": i for i in range(70)}, {**{f"k{i}": i for i in range(70)}, "k3": 999}),
        (["gpt", [1, [2, [3, [4]]]]], ["gpt", [1, [2, [3, [5]]]]]),
        (list(range(100)), [*range(99), 1000]),
    ],
)
def test_a_nested_or_long_cache_key_is_keyed_by_every_value(tmp_path, one, other):
    """A ``cache_key`` (documented as JSON-able data, e.g. a flattened config) was keyed like
    a closure's cells: past three levels by its class name, past 64 items by its length, so a
    changed width deep in it (or in a long one) was served the other config's answer."""
    assert _key(lambda size: None, one) != _key(lambda size: None, other)
    assert _key(lambda size: None, one) == _key(lambda size: None, json.loads(json.dumps(one)))
    find_max_batch(ThresholdStep(100), cache_key=one, steps_per_trial=1, cache=tmp_path)
    fn = ThresholdStep(200)
    result = find_max_batch(fn, cache_key=other, steps_per_trial=1, cache=tmp_path)
    assert not result.cached and result.batch_size == 200


# -- what the optimizer trains -----------------------------------------------------------------
def _subset_step(layer: int) -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 512))
    optimizer = torch.optim.Adam(model[layer].parameters())
    return autobatch.TrainStep(model, optimizer, lambda m, b: m(b).sum(), make_batch=lambda n: torch.randn(n, 16))


def test_the_parameters_an_optimizer_trains_are_in_the_key():
    """Adam over the small first layer or the large last one holds 2 or 8 k-parameter moments,
    but each group was keyed by its parameter count (2 and 2): the same key."""
    assert _key(_subset_step(0)) != _key(_subset_step(2))
    assert _key(_subset_step(2)) == _key(_subset_step(2))


# -- the attention backends --------------------------------------------------------------------
class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(64, 64)

    def forward(self, x):
        q = self.qkv(x).view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).sum()


def _attention_step() -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = _Attention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return autobatch.TrainStep(model, optimizer, lambda m, b: m(b), make_batch=lambda n: torch.randn(n, 256, 64))


def test_the_attention_backends_are_in_the_key(tmp_path):
    """With the fused attention kernels off (``enable_flash_sdp(False)``, ``sdpa_kernel(MATH)``)
    attention keeps its score matrix: 19 instead of 168 fit here, but the answer found with
    them on was served (cached=True, 168)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = dict(memory_limit="64MiB", steps_per_trial=1, max_batch=4096, strategy="binary", cache=tmp_path)
    fused = find_max_batch(_attention_step(), **args)
    before = _key(_attention_step())
    with sdpa_kernel([SDPBackend.MATH]):
        assert _key(_attention_step()) != before
        math = find_max_batch(_attention_step(), **args)
    assert not math.cached and math.batch_size < fused.batch_size
    assert _key(_attention_step()) == before and find_max_batch(_attention_step(), **args).cached


# -- hooks on parameters -----------------------------------------------------------------------
def test_a_hook_on_a_parameter_is_in_the_key():
    """A post-accumulate-grad hook (an optimizer stepped in backward frees each gradient) or a
    gradient hook that keeps a copy changes what a step holds; only module hooks were keyed."""
    plain = make_mlp_step(width=64)
    hooked = make_mlp_step(width=64)
    hooked.model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    assert _key(hooked) != _key(plain)
    kept = []
    copied = make_mlp_step(width=64)
    copied.model[2].weight.register_hook(lambda grad: kept.append(grad.clone()))
    assert _key(copied) != _key(plain)
    assert _key(make_mlp_step(width=64)) == _key(plain)


# -- the optimizer's class ---------------------------------------------------------------------
class Adam(torch.optim.Adam):
    """A user's optimizer named as torch's, which keeps one more buffer per parameter."""

    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param].setdefault("ema", torch.zeros_like(param))
        return super().step(closure)


def test_an_optimizer_is_keyed_by_its_module_and_code():
    """Classes were keyed by ``__qualname__`` alone: a user's (or a library's, bitsandbytes')
    ``Adam`` took the answer of ``torch.optim.Adam``, and an edit of a user optimizer's
    ``step`` went unnoticed."""
    step = make_mlp_step(width=64)
    before = _key(step)
    step.optimizer = Adam(step.model.parameters(), lr=1e-3)
    assert _key(step) != before


# -- NumPy arrays ------------------------------------------------------------------------------
class _WithTable(torch.nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.table = np.random.rand(size)  # random values, new in every run

    def forward(self, x):
        return self.fc(x)


def _table_step(size: int) -> autobatch.TrainStep:
    model = _WithTable(size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return autobatch.TrainStep(model, optimizer, lambda m, b: m(b).sum(), make_batch=lambda n: torch.randn(n, 8))


def test_a_numpy_array_is_keyed_by_its_shape_not_its_values():
    """A module attribute that is a NumPy array was keyed by its repr, its values: one
    initialised at random missed the cache in every new run."""
    assert _key(_table_step(4)) == _key(_table_step(4))
    assert _key(_table_step(4)) != _key(_table_step(5))


# -- a hand-edited entry -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, bad",
    [("promise", "x"), ("promise", [1]), ("diagnostics", "x"), ("diagnostics", [1]), ("fit", "x"), ("estimate", 3),
     ("fallback_reason", 5), ("trials", ["x"]), ("trial.peak_bytes", "lots"), ("trial.passed", "yes")],
)  # fmt: skip
def test_a_damaged_entry_is_a_miss_not_a_crash(tmp_path, caplog, field, bad):
    """A stored ``promise`` or ``diagnostics`` that is not an object crashed the hit
    (``'str' object has no attribute 'pop'``) or its table, a trial's ``peak_bytes`` that is
    not a number crashed ``summary()``: damaged entries must be warned-about misses."""
    from autobatch.cli.display import render_table

    step = make_mlp_step(width=64)
    args = dict(memory_limit="32MiB", steps_per_trial=1, max_batch=4096, cache=tmp_path)
    first = find_max_batch(step, **args)
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    if field.startswith("trial."):
        entry["result"]["trials"][-1][field.removeprefix("trial.")] = bad
    else:
        entry["result"][field] = bad
    path.write_text(json.dumps(entry))
    probe_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        again = find_max_batch(make_mlp_step(width=64), **args)
    again.summary(), render_table(again)
    assert not again.cached and again.batch_size == first.batch_size
    assert any("malformed result" in r.getMessage() for r in caplog.records)
    assert find_max_batch(make_mlp_step(width=64), **args).cached  # rewritten


# -- a shared cache directory ------------------------------------------------------------------
def test_an_entry_is_readable_as_the_umask_allows(tmp_path):
    """Entries were written with ``mkstemp``'s mode 0600: in a cache shared by a team
    (``AUTOBATCH_CACHE_DIR`` group-writable) no one else could read them, so every user
    re-probed, warned, and overwrote the others' entries."""
    old = os.umask(0o022)
    try:
        find_max_batch(ThresholdStep(50), cache_key="x", steps_per_trial=1, cache=tmp_path)
    finally:
        os.umask(old)
    (path,) = tmp_path.glob("*.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# -- channels-last layouts, the allocator's other settings, a disabled grad scaler --------------
def _conv_step(channels_last: bool, scaler=None) -> autobatch.TrainStep:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=layout)
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(),
                               make_batch=lambda n: torch.randn(n, 3, 16, 16).to(memory_format=layout),
                               grad_scaler=scaler)


def test_a_channels_last_model_and_input_are_keyed_apart():
    """Convolutions over channels-last tensors pick other kernels and workspaces: a model and
    inputs converted to channels-last were served the contiguous model's answer."""
    assert _key(_conv_step(True)) != _key(_conv_step(False))
    assert _key(_conv_step(False)) == _key(_conv_step(False))


def test_the_allocators_other_settings_are_in_a_cuda_key(monkeypatch):
    """``max_split_size_mb`` or ``garbage_collection_threshold`` change where free memory sits;
    only ``expandable_segments`` was keyed. Where none is set the key is what it was."""
    step = make_mlp_step(seed=0)

    def key() -> str:
        return probe_cache.key_of(probe_cache.key_components(step, cache_key=None, device="cuda:0", capacity=2**34,
                                                             memory_limit=None, probe={}))

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    plain = key()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    split = key()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, garbage_collection_threshold:0.8")
    both = key()
    assert len({plain, split, both}) == 3
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8,max_split_size_mb:512")
    assert key() == both  # the same settings in another order
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert key() == plain  # keyed on its own (what the allocator runs with), not twice
    assert "allocator" not in probe_cache.key_components(step, cache_key=None, device="cpu", capacity=2**30,
                                                         memory_limit=None, probe={})["device"]


def test_a_disabled_grad_scaler_is_keyed_apart_from_an_enabled_one():
    enabled = torch.amp.GradScaler("cpu")
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert _key(_conv_step(False, enabled)) != _key(_conv_step(False, disabled))
