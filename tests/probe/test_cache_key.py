"""The probe cache key's reading of code: stable across processes."""

import dataclasses
import functools
import os
import pathlib
import subprocess
import sys
import types

import torch

import autobatch
from autobatch import find_max_batch
from autobatch.probe.caching.cache_key import key_of, step_components

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def _keys_under_two_hash_seeds(script) -> set[str]:
    """What ``script`` prints (a key) in two processes whose hash seeds differ."""
    return {subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}).stdout for seed in ("1", "2")}


def test_a_set_literal_in_the_code_is_keyed_the_same_under_any_hash_seed(tmp_path):
    """``x in {"gelu", "relu"}`` compiles to a frozenset constant whose repr's order follows
    PYTHONHASHSEED: keyed by its repr, the same code got another key in every new process, and
    the persistent cache never hit (transformers' models read one through strtobool)."""
    script = tmp_path / "key.py"
    script.write_text(
        "from autobatch.probe.caching.cache_key import _code_hash\n"
        "def act(x):\n    return x in {'gelu', 'relu', 'silu', 'tanh', 'swish', 'mish', 'quick_gelu'}\n"
        "print(_code_hash(act))\n")
    assert len(_keys_under_two_hash_seeds(script)) == 1


@dataclasses.dataclass
class Config:
    passes: int = 1


CONFIG = Config()
NAMESPACE = types.SimpleNamespace(width=32)


class Net(torch.nn.Module):
    """Reads a module-level dataclass and namespace config: its activations grow with them."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 32)

    def forward(self, x):
        for _ in range(CONFIG.passes * NAMESPACE.width // 32):
            x = torch.tanh(self.layer(x))
        return x


def test_a_module_level_config_object_is_keyed_by_its_state(tmp_path):
    """Objects among the globals were skipped: after CONFIG.passes = 8 the cache answered the
    batch found with one pass (1365 where 630 fits)."""
    torch.manual_seed(0)
    model = Net()
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(),
                               lambda n: torch.randn(n, 32))
    first = key_of(step_components(step))
    try:
        CONFIG.passes = 8
        deeper = key_of(step_components(step))
        CONFIG.passes, NAMESPACE.width = 1, 64
        wider = key_of(step_components(step))
    finally:
        CONFIG.passes, NAMESPACE.width = 1, 32
    assert len({first, deeper, wider}) == 3 and key_of(step_components(step)) == first
    one = find_max_batch(step, device="cpu", memory_limit="1MiB", strategy="binary", cache=tmp_path)
    try:
        CONFIG.passes = 8
        eight = find_max_batch(step, device="cpu", memory_limit="1MiB", strategy="binary", cache=tmp_path)
    finally:
        CONFIG.passes = 1
    assert not eight.cached and eight.batch_size < one.batch_size


def test_a_global_object_is_keyed_the_same_in_every_process(tmp_path):
    """Keyed by its state, never by what differs between processes: a set's order under the hash
    seed, an object's address, a logger's or a lock's state."""
    script = tmp_path / "key.py"
    script.write_text(
        "import logging, threading, types\n"
        "from autobatch.probe.caching.cache_key import _code_hash\n"
        "CFG = types.SimpleNamespace(acts={'gelu', 'relu', 'silu', 'tanh', 'swish'}, n=3, token=object())\n"
        "LOG, LOCK = logging.getLogger('user'), threading.Lock()\n"
        "def forward(x):\n    LOG.debug('x')\n    with LOCK:\n        return x * CFG.n, CFG.acts, CFG.token\n"
        "print(_code_hash(forward))\n")
    assert len(_keys_under_two_hash_seeds(script)) == 1


SEQ_LEN = 8  # read by _global_seq_step below


def _global_seq_step(n):
    torch.randn(n, SEQ_LEN, 4)


def test_review32_a_plain_callables_settings_are_keyed():
    """A plain callable under one ``cache_key`` was keyed by its code and ``restore`` only: the
    sequence length in its closure, at module level or in a ``partial`` was not, and 4x the
    activations were served the shorter sequence's answer. A counter it rebinds and a list it
    appends to stay out of the key (every call would miss)."""
    from autobatch.probe.caching.cache_key import key_components

    def key(fn):
        return key_of(key_components(fn, cache_key="k", device="cpu", capacity=None, memory_limit=None, probe={}))

    def closure(seq_len):
        losses, calls = [], 0

        def step(n):
            nonlocal calls
            calls += 1
            losses.append(torch.randn(n, seq_len, 4).sum().item())
        return step

    assert key(closure(8)) != key(closure(32))
    counted = closure(8)
    before = key(counted)
    counted(2)
    assert key(counted) == before  # its counter and its losses changed: still a hit
    global SEQ_LEN
    before = key(_global_seq_step)
    SEQ_LEN = 32
    try:
        assert key(_global_seq_step) != before
    finally:
        SEQ_LEN = 8

    def by_keyword(n, seq_len=8):
        torch.randn(n, seq_len, 4)

    assert key(functools.partial(by_keyword, seq_len=8)) != key(functools.partial(by_keyword, seq_len=32))
