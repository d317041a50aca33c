"""The persistent probe cache: keys, hits and misses, concurrent writers, corrupt files (CPU)."""

import errno
import json
import logging
import os
import time
import multiprocessing

from pathlib import Path

import pytest
import torch

import autobatch
from autobatch import cache as probe_cache
from autobatch import find_max_batch
from autobatch.planning.checkpointing import enable_checkpointing

from workloads import ThresholdStep, make_mlp_step

PROBE = dict(memory_limit="32MiB", steps_per_trial=1, max_batch=4096)


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path / "explicit"))
    assert probe_cache.default_dir() == tmp_path / "explicit"
    monkeypatch.delenv("AUTOBATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert probe_cache.default_dir() == tmp_path / "xdg" / "autobatch"


def test_default_dir_expands_a_tilde_in_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOBATCH_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert probe_cache.default_dir() == tmp_path / "xdg" / "autobatch"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # ignored, as the XDG specification says
    assert probe_cache.default_dir() == tmp_path / ".cache" / "autobatch"


def test_a_train_step_is_cached_by_default_and_a_hit_runs_nothing(isolated_probe_cache):
    step = make_mlp_step(width=64)
    calls = []  # the same counting make_batch in both calls: its code is in the key
    step.make_batch = lambda size, make=step.make_batch: calls.append(size) or make(size)
    first = find_max_batch(step, **PROBE)
    assert not first.cached and first.num_trials > 0
    assert len(probe_cache.list_entries()) == 1
    calls.clear()
    second = find_max_batch(step, **PROBE)
    assert second.cached and second.batch_size == first.batch_size
    assert [size for size in calls if size > 2] == []  # only the key's fake batches of 1 and 2
    assert any("probe cache" in note for note in second.notes)
    assert autobatch.ProbeResult.from_dict(second.to_dict()).cached
    # the storing probe's notes say so (no trial ran in this call); stored again, not twice
    assert [f"stored probe: {note}" for note in first.notes] == second.notes[:len(first.notes)]
    assert find_max_batch(step, **PROBE).notes == second.notes


def test_off_switch_and_explicit_directory(tmp_path, isolated_probe_cache):
    step = make_mlp_step(width=64)
    find_max_batch(step, cache=False, **PROBE)
    assert probe_cache.list_entries() == []
    find_max_batch(step, cache=tmp_path / "mine", **PROBE)
    assert probe_cache.list_entries() == [] and len(probe_cache.list_entries(tmp_path / "mine")) == 1
    assert find_max_batch(step, cache=tmp_path / "mine", **PROBE).cached


def test_plain_callables_need_a_cache_key():
    find_max_batch(ThresholdStep(100), steps_per_trial=1)
    find_max_batch(ThresholdStep(100), steps_per_trial=1)
    assert probe_cache.list_entries() == []
    explicit = find_max_batch(ThresholdStep(100), cache=True, steps_per_trial=1)
    assert not explicit.cached and any("cache_key" in note for note in explicit.notes)
    find_max_batch(ThresholdStep(100), cache_key="threshold-100", steps_per_trial=1)
    fn = ThresholdStep(100)
    hit = find_max_batch(fn, cache_key="threshold-100", steps_per_trial=1)
    assert hit.cached and hit.batch_size == 100 and fn.calls == []
    assert not find_max_batch(ThresholdStep(100), cache_key="threshold-101", steps_per_trial=1).cached


def test_review31_a_plain_callables_cache_key_misses_for_another_model(tmp_path):
    """A plain callable cached under ``cache_key`` with ``restore=(model, optimizer)``: a wider model
    under the same key was served the narrower one's answer, and training at it ran out of memory.
    The modules and optimizers in ``restore`` (and the callable's code) are keyed beside it now."""
    def probe(width):
        model = torch.nn.Linear(4, width)
        return find_max_batch(ThresholdStep(4096 // width), restore=(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                              cache_key="mlp", steps_per_trial=1, cache=tmp_path)
    assert probe(8).batch_size == 512 and probe(8).cached
    wider = probe(16)
    assert not wider.cached and wider.batch_size == 256
    assert probe(16).cached


def _variant(name: str):
    """A step and probe arguments that differ from the baseline in exactly one component."""
    step = make_mlp_step(width=64)
    args = dict(PROBE)
    if name == "baseline":
        pass
    elif name == "model-shape":
        step = make_mlp_step(width=65)
    elif name == "param-dtype":
        step.model.double()
        step.make_batch = lambda size: (torch.randn(size, 64, dtype=torch.float64), torch.randint(0, 10, (size,)))
    elif name == "structure":
        step.model[1] = torch.nn.GELU()
    elif name == "input-shape":
        # same model and loss, one more (unused) input tensor per sample
        step.make_batch = lambda size: (torch.randn(size, 64), torch.randint(0, 10, (size,)), torch.zeros(size, 8))
    elif name == "optimizer":
        step = make_mlp_step(width=64, optimizer="sgd")
    elif name == "module-setting":
        step.model[1].inplace = True  # ReLU(inplace=True) keeps one activation fewer
    elif name == "eval-mode":
        step.model.eval()
    elif name == "clipping":
        step.max_grad_norm = 1.0
    elif name == "precision":
        step.autocast_dtype = torch.bfloat16
    elif name == "checkpointing":
        step.model = torch.nn.Sequential(*step.model)  # same structure ...
        enable_checkpointing(step.model, modules=["0"])  # ... one block checkpointed
    elif name == "memory-cap":
        args["memory_limit"] = "48MiB"
    elif name == "strategy":
        args["strategy"] = "binary"
    elif name == "margin":
        args["margin"] = 0.1
    elif name == "multiple_of":
        args["multiple_of"] = 2
    elif name == "steps_per_trial":
        args["steps_per_trial"] = 2
    elif name == "max_batch":
        args["max_batch"] = 2048
    else:
        raise AssertionError(name)
    return step, args


COMPONENTS = [
    "model-shape", "param-dtype", "structure", "module-setting", "eval-mode", "clipping", "input-shape", "optimizer", "precision",
    "checkpointing",
    "memory-cap", "strategy", "margin", "multiple_of", "steps_per_trial", "max_batch",
]


def _key(step, args) -> str:
    from autobatch.memory.devices import memory_for, resolve_device
    from autobatch.memory.units import parse_bytes

    limit = parse_bytes(args["memory_limit"])
    with memory_for(resolve_device("cpu"), limit) as (memory, _):
        name, capacity = memory.name, memory.capacity()
    probe = {k: args.get(k) for k in ("strategy", "start", "max_batch", "margin", "multiple_of", "steps_per_trial")}
    probe["strategy"] = probe["strategy"] or "auto"
    return probe_cache.key_of(
        probe_cache.key_components(step, device=name, capacity=capacity, memory_limit=limit, probe=probe)
    )


def test_the_key_is_stable():
    assert _key(*_variant("baseline")) == _key(*_variant("baseline"))
    step, args = _variant("baseline")
    step.optimizer.param_groups[0]["lr"] = 0.5  # the learning rate does not change memory
    assert _key(step, args) == _key(*_variant("baseline"))


@pytest.mark.parametrize("component", COMPONENTS)
def test_changing_one_component_misses(component):
    assert _key(*_variant(component)) != _key(*_variant("baseline"))


def test_a_cuda_answer_is_keyed_by_the_allocator_segments(monkeypatch):
    """Expandable segments change what fits at the edge of memory (issue 16): an answer found
    with them is not served without them. Off CUDA the setting is not part of the key."""
    step, _ = _variant("baseline")

    def key(device: str, expandable: bool) -> str:
        monkeypatch.setattr("autobatch.probe.caching.cache_key.expandable_segments", lambda: expandable)
        return probe_cache.key_of(probe_cache.key_components(step, device=device, capacity=2**33, memory_limit=None, probe={}))

    assert key("cuda:0 (NVIDIA H200)", True) != key("cuda:0 (NVIDIA H200)", False)
    assert key("cpu (simulated 64.00 MiB)", True) == key("cpu (simulated 64.00 MiB)", False)


@pytest.mark.parametrize("component", ["model-shape", "optimizer", "memory-cap", "margin"])
def test_a_changed_component_reprobes(component):
    find_max_batch(*_variant("baseline")[:1], **_variant("baseline")[1])
    step, args = _variant(component)
    assert not find_max_batch(step, **args).cached
    assert find_max_batch(*_variant("baseline")[:1], **_variant("baseline")[1]).cached


def test_a_changed_allocator_headroom_reprobes(monkeypatch):
    """Answers cached under another headroom (before it existed: none) are not served."""
    import autobatch.probe.arguments

    step, args = _variant("baseline")
    find_max_batch(step, **args)
    assert find_max_batch(*_variant("baseline")[:1], **args).cached
    monkeypatch.setattr(autobatch.probe.arguments, "ALLOCATOR_HEADROOM", 0.0)
    assert not find_max_batch(*_variant("baseline")[:1], **args).cached
    assert find_max_batch(*_variant("baseline")[:1], **args).cached
    # the headroom under expandable segments decides them too
    monkeypatch.setattr(autobatch.probe.arguments, "EXPANDABLE_HEADROOM_BYTES", 0)
    assert not find_max_batch(*_variant("baseline")[:1], **args).cached


def test_torch_version_is_in_the_key(monkeypatch):
    baseline = _key(*_variant("baseline"))
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert _key(*_variant("baseline")) != baseline


def test_autobatchs_own_code_is_in_the_key(monkeypatch, tmp_path):
    """An answer an older checkout or editable install cached is not served after autobatch's code
    changed (the version number changes only at a release)."""
    import autobatch.probe.caching.cache_key
    from autobatch.version import code_fingerprint

    baseline = _key(*_variant("baseline"))
    monkeypatch.setattr(autobatch.probe.caching.cache_key, "code_fingerprint", lambda: "another-commit")
    assert _key(*_variant("baseline")) != baseline
    # the fingerprint reads the package's files: a changed file changes it
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "version.py").write_text((Path(autobatch.__file__).parent / "version.py").read_text())
    (package / "other.py").write_text("A = 1\n")
    import importlib.util

    def fingerprint() -> str:
        spec = importlib.util.spec_from_file_location("copied_version", package / "version.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.code_fingerprint()

    before = fingerprint()
    (package / "other.py").write_text("A = 2\n")
    assert fingerprint() != before and len(before) == 16 and code_fingerprint() == code_fingerprint()


def test_corrupt_and_foreign_files_warn_once_and_miss(isolated_probe_cache, caplog):
    step = make_mlp_step(width=64)
    first = find_max_batch(step, **PROBE)
    (entry,) = probe_cache.list_entries()
    probe_cache._warned.clear()
    for content in ["{not json", json.dumps({"kind": "something else"}), "\x00\xff"]:
        if content == "\x00\xff":
            entry.path.write_bytes(b"\x00\xff")
        else:
            entry.path.write_text(content)
        probe_cache._warned.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="autobatch"):
            again = find_max_batch(step, **PROBE)
            assert not again.cached and again.batch_size == first.batch_size
            assert probe_cache.list_entries()[0].key == entry.key  # rewritten, valid again
            entry.path.write_text("{not json")
            assert probe_cache.ProbeCache().get(entry.key) is None
            assert probe_cache.ProbeCache().get(entry.key) is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "probe cache" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
    data = json.loads(json.dumps({"schema": 999, "kind": probe_cache.KIND, "key": entry.key}))
    entry.path.write_text(json.dumps(data))
    assert probe_cache.ProbeCache().get(entry.key) is None


def test_list_and_clear(isolated_probe_cache):
    find_max_batch(make_mlp_step(width=64), **PROBE)
    find_max_batch(ThresholdStep(50), cache_key="x", steps_per_trial=1)
    entries = probe_cache.list_entries()
    assert len(entries) == 2 and {e.batch_size for e in entries} >= {50}
    assert any("model" in e.components for e in entries)
    assert probe_cache.clear() == 2
    assert probe_cache.list_entries() == [] and probe_cache.clear() == 0


def test_clear_deletes_only_cache_entries(tmp_path):
    """``cache clear --dir`` may name a directory that holds more than the cache: a run's
    result.json, a user's settings, a file that is not JSON, another program's temporary all stay;
    an entry of an older schema goes (abandoned temporaries: test_review32_clear_*)."""
    find_max_batch(ThresholdStep(50), cache_key="x", steps_per_trial=1, cache=tmp_path)
    (tmp_path / "result.json").write_text(json.dumps({"batch_size": 3}))
    (tmp_path / "notes.json").write_text("not json")
    (tmp_path / "old.json").write_text(json.dumps({"kind": probe_cache.KIND, "schema": 0}))
    (tmp_path / ".tmp-123.json").write_text("{")
    assert probe_cache.clear(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [".tmp-123.json", "notes.json", "result.json"]


def test_review32_clear_deletes_only_abandoned_temporaries(tmp_path):
    """``clear`` deleted every ``.tmp-*.json``: a writer's temporary between ``mkstemp`` and
    ``os.replace`` (its entry was then lost) and another program's in a ``--dir`` that holds more.
    Now only a temporary of ``put``'s naming, untouched for ``ABANDONED_AFTER_S`` and empty or the
    start of an entry, goes (a writer killed mid-write); it is not counted as an entry."""
    store = probe_cache.ProbeCache(tmp_path)
    result = find_max_batch(ThresholdStep(50), cache_key="x", steps_per_trial=1, cache=tmp_path)
    [entry] = tmp_path.glob("[0-9a-f]*.json")
    text = entry.read_text()
    old = time.time() - probe_cache.ABANDONED_AFTER_S - 60
    files = {".tmp-k1ll3d_0.json": text[:300], ".tmp-00000000.json": "", ".tmp-settings.json": "{}",
             ".tmp-0th3rp9m.json": '{"another": "program"}', ".tmp-w0rk1ng0.json": text[:300]}
    for name, content in files.items():
        (tmp_path / name).write_text(content)
        if name != ".tmp-w0rk1ng0.json":  # a writer still writing this one
            os.utime(tmp_path / name, (old, old))
    assert store.clear() == 1
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == [".tmp-0th3rp9m.json", ".tmp-settings.json",
                                                                 ".tmp-w0rk1ng0.json"]
    (tmp_path / ".tmp-w0rk1ng0.json").write_text(text)  # the writer finishes: its entry is served
    os.replace(tmp_path / ".tmp-w0rk1ng0.json", entry)
    assert store.get(entry.stem).batch_size == result.batch_size


def test_review32_a_deeply_nested_entry_file_is_a_miss(isolated_probe_cache, caplog):
    """A corrupt entry that nests too deep for ``json`` (``[[[[...``) raised ``RecursionError`` out
    of ``find_max_batch`` and ``cache list``: it is one warning and a miss, and the probe rewrites it."""
    probe = dict(cache_key="x", steps_per_trial=1)
    find_max_batch(ThresholdStep(50), **probe)
    [entry] = probe_cache.list_entries()
    entry.path.write_text("[" * 100_000)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert probe_cache.list_entries() == []
        again = find_max_batch(ThresholdStep(50), **probe)
    assert not again.cached and again.num_trials > 0 and again.batch_size == 50
    [line] = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert line.startswith(f"ignoring probe cache file {entry.path}: not readable JSON (RecursionError: ")
    assert find_max_batch(ThresholdStep(50), **probe).cached


def _writer(directory: str, worker: int, rounds: int) -> None:
    store = probe_cache.ProbeCache(directory)
    result = autobatch.ProbeResult(
        batch_size=worker + 1, strategy="binary", strategy_used="binary", trials=[], capacity_bytes=1, elapsed_s=0.0,
        margin=0.0, notes=["x" * 20000],
    )
    for index in range(rounds):
        key = probe_cache.key_of({"shared": index % 3})
        store.put(key, {"shared": index % 3}, result)
        got = store.get(key)
        assert got is not None and got.cached


def test_concurrent_writers_leave_a_valid_cache(tmp_path):
    directory = str(tmp_path / "shared")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(directory, worker, 15)) for worker in range(4)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(120)
    assert [process.exitcode for process in workers] == [0, 0, 0, 0]
    files = sorted((tmp_path / "shared").glob("*.json"))
    assert len(files) == 3
    for path in files:
        json.loads(path.read_text())
    assert len(probe_cache.list_entries(directory)) == 3


_KEY_SCRIPT = """
import sys, torch
sys.path[:0] = ["tests", "."]
from autobatch import cache
from workloads import make_mlp_step
step = make_mlp_step(width=64)
step.loss_fn = lambda model, batch: sum(x for x in [model(batch[0]).mean()])  # nested code object
print(cache.key_of(cache.key_components(step, device="cpu", capacity=1, memory_limit=None, probe={})))
"""


def test_the_key_is_the_same_in_another_process():
    import subprocess
    import sys

    keys = {
        subprocess.run([sys.executable, "-c", _KEY_SCRIPT], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert len(keys) == 1 and len(keys.pop()) == 64


def test_cudnn_autotuning_is_in_the_key(monkeypatch):
    """Autotuned convolutions pick other workspaces: an answer found without autotuning is not
    served to a run with it (the CLI's ``device.cudnn_benchmark``), nor the other way round."""
    baseline = _key(*_variant("baseline"))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not torch.backends.cudnn.benchmark)
    assert _key(*_variant("baseline")) != baseline



class _Config:
    def __init__(self, n_passes: int) -> None:
        self.n_passes = n_passes


class _Repeated(torch.nn.Module):
    """A model whose activations grow with a setting held in a config object."""

    scale = 1  # a class attribute forward reads

    def __init__(self, config: _Config) -> None:
        super().__init__()
        self.config = config
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(self.config.n_passes * self.scale):
            x = self.layer(x)
        return x


N_PASSES = 1  # a global a loss reads


def _step_with(config=1, loss=None, scale=1):
    model = _Repeated(_Config(config))
    model.scale = scale if scale != 1 else model.scale
    loss = loss or (lambda m, b: m(b).square().mean())
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, lambda n: torch.randn(n, 8))


def _step_key(step) -> str:
    return probe_cache.key_of(probe_cache.key_components(step, device="cpu", capacity=2**26, memory_limit=None, probe={}))


def test_the_key_follows_the_values_the_code_reads():
    """A config object's fields, a class attribute, a partial's arguments, a closure's cells and
    the plain globals a loss names all change the answer, so they change the key (each was
    served a stale answer about twice too large)."""
    import functools

    def loss_over(m, b, passes):
        return sum(m(b).square().mean() for _ in range(passes))

    def closure_over(passes):
        return lambda m, b: sum(m(b).square().mean() for _ in range(passes))

    def global_loss(m, b):
        return sum(m(b).square().mean() for _ in range(N_PASSES))

    assert _step_key(_step_with(config=1)) != _step_key(_step_with(config=4))
    assert _step_key(_step_with(scale=1)) == _step_key(_step_with(scale=1))
    assert _step_key(_step_with(loss=functools.partial(loss_over, passes=1))) != _step_key(
        _step_with(loss=functools.partial(loss_over, passes=4)))
    assert _step_key(_step_with(loss=closure_over(1))) != _step_key(_step_with(loss=closure_over(4)))
    before = _step_key(_step_with(loss=global_loss))
    globals()["N_PASSES"] = 4
    try:
        assert _step_key(_step_with(loss=global_loss)) != before
    finally:
        globals()["N_PASSES"] = 1
    assert _step_key(_step_with(config=1)) == _step_key(_step_with(config=1))  # stable across instances
    from autobatch.probe.caching.cache_key import _code_hash

    assert _code_hash(torch.sum) != _code_hash(torch.mean)  # builtins keep their names (C code has no bytecode)


def test_a_class_attribute_read_in_forward_changes_the_key(monkeypatch):
    before = _step_key(_step_with())
    monkeypatch.setattr(_Repeated, "scale", 3)
    assert _step_key(_step_with()) != before


def test_a_cache_key_object_is_keyed_by_its_fields(tmp_path):
    """An object passed as cache_key is keyed by its public fields, not its class name alone."""

    def components(key):
        return probe_cache.key_components(lambda n: None, cache_key=key, device="cpu", capacity=2**26,
                                          memory_limit=None, probe={})

    assert probe_cache.key_of(components(_Config(1024))) != probe_cache.key_of(components(_Config(4096)))
    assert probe_cache.key_of(components(_Config(1024))) == probe_cache.key_of(components(_Config(1024)))


GATES = {"gates": 1}  # a global config dict forward reads


def _helper_loss(m, b):  # a helper the loss calls
    return m(b).square().mean()


class _WithHelper(torch.nn.Module):
    """forward calls a helper method, reads a global dict and a private setting."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self._reps = 1

    def body(self, x):
        return self.layer(x)

    def forward(self, x):
        for _ in range(GATES["gates"] * self._reps):
            x = self.body(x)
        return x


class _LossModule(torch.nn.Module):
    def __init__(self, views: int) -> None:
        super().__init__()
        self.views = views

    def forward(self, m, b):
        return sum(m(b * (i + 1)).square().mean() for i in range(self.views))


def _helper_step(loss=None, model=None):
    model = model or _WithHelper()
    loss = loss or (lambda m, b: _helper_loss(m, b))
    return autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, lambda n: torch.randn(n, 8))


def test_the_key_follows_helpers_global_containers_private_settings_hooks_and_loss_modules(monkeypatch):
    """Each of these changed the answer and was served a stale one: a helper method forward
    calls, a helper function the loss calls, a global dict forward reads, a private setting, a
    forward hook that keeps activations, and a loss that is a module (every one keyed as
    Module.__call__)."""
    before = _step_key(_helper_step())
    assert _step_key(_helper_step()) == before  # stable

    monkeypatch.setattr(_WithHelper, "body", lambda self, x: self.layer(x) * torch.sigmoid(self.layer(x)))
    assert _step_key(_helper_step()) != before
    monkeypatch.undo()

    def three_times(m, b):
        return sum(m(k * b).square().mean() for k in (1, 2, 3))

    monkeypatch.setitem(globals(), "_helper_loss", three_times)
    assert _step_key(_helper_step()) != before
    monkeypatch.undo()

    monkeypatch.setitem(GATES, "gates", 4)
    assert _step_key(_helper_step()) != before
    monkeypatch.undo()

    model = _WithHelper()
    model._reps = 3
    assert _step_key(_helper_step(model=model)) != before

    model = _WithHelper()
    kept = []
    model.layer.register_forward_hook(lambda module, args, out: kept.append(out))
    assert _step_key(_helper_step(model=model)) != before

    assert _step_key(_helper_step(loss=_LossModule(1))) != _step_key(_helper_step(loss=_LossModule(4)))
    assert _step_key(_helper_step(loss=_LossModule(2))) == _step_key(_helper_step(loss=_LossModule(2)))


@pytest.mark.parametrize(
    "field, bad",
    [("batch_size", "4096"), ("batch_size", -3), ("batch_size", 0), ("batch_size", None), ("batch_size", True),
     ("margin", 1.5), ("notes", [3]), ("multiple_of", 0), ("capacity_bytes", "1")],
)  # fmt: skip
def test_an_entry_whose_result_is_impossible_warns_once_and_misses(tmp_path, caplog, field, bad):
    """Valid JSON with a batch size of "4096", -3, 0 or null used to be served as the answer
    (cached=True), and null crashed ``list_entries`` (``int(None)``)."""
    step = ThresholdStep(50)
    first = find_max_batch(step, cache_key="x", steps_per_trial=1, cache=tmp_path)
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    entry["result"][field] = bad
    path.write_text(json.dumps(entry))
    probe_cache._warned.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert probe_cache.ProbeCache(tmp_path).get(path.stem) is None
        assert probe_cache.list_entries(tmp_path) == []
    warnings = [r.getMessage() for r in caplog.records if "probe cache file" in r.getMessage()]
    assert len(warnings) == 1 and "malformed result" in warnings[0] and field in warnings[0], warnings
    again = find_max_batch(step, cache_key="x", steps_per_trial=1, cache=tmp_path)
    assert not again.cached and again.batch_size == first.batch_size == 50
    assert [e.batch_size for e in probe_cache.list_entries(tmp_path)] == [50]  # rewritten


def refuse_lock_files(monkeypatch, directory, code):
    """``os.open`` refusing to create files in ``directory`` with errno ``code`` (a read-only
    directory, even for root)."""
    real = os.open

    def refusing(path, flags, *args, **kwargs):
        if str(path).startswith(str(directory)) and flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), str(path))  # PermissionError, FileNotFoundError
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


@pytest.mark.parametrize("code", [errno.EACCES, errno.ENOENT, errno.EROFS])
def test_a_lock_file_that_cannot_be_created_fails_fast_and_warns_once(tmp_path, caplog, monkeypatch, code):
    """ENOENT from creating the lock file used to be retried for filelock's whole 60 s timeout
    (every probe +60 s, then a warning as if another process held the lock); EACCES warned on
    every write, and ``clear`` raised the raw error."""
    result = autobatch.ProbeResult(
        batch_size=3, strategy="binary", strategy_used="binary", trials=[], capacity_bytes=1, elapsed_s=0.0, margin=0.0
    )
    store = probe_cache.ProbeCache(tmp_path)
    probe_cache._warned.clear()
    refuse_lock_files(monkeypatch, tmp_path, code)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        assert store.put("a" * 64, {}, result) is None
        assert store.put("b" * 64, {}, result) is None
    assert time.monotonic() - began < 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{tmp_path / '.lock'}" in warnings[0] and "not cached" in warnings[0], warnings
    with pytest.raises(probe_cache.CacheLockError, match="cannot create the probe cache lock file"):
        store.clear()
    assert time.monotonic() - began < 10
