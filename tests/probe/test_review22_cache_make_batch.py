"""The probe cache key holds ``make_batch``'s code and the plain values it reads, not only the
shapes of ``make_batch(1)`` and ``make_batch(2)``: a make_batch that pads to the longest of its
samples, capped at ``max_length``, builds the same two small batches under 128 and 512, and the
512 run was served the 128 run's answer."""

import functools

import torch
from torch import nn

import autobatch
from autobatch import cache as probe_cache
from autobatch.probe.caching.cache_key import key_of

LENGTHS = [3, 5, 700, 900]  # the first two samples are short: batches of 1 and 2 are not padded far


def _padded(n, max_length=128):
    longest = min(max(LENGTHS[i % len(LENGTHS)] for i in range(n)), max_length)
    return torch.randint(0, 50, (n, longest))


class _Batches:
    def __init__(self, max_length):
        self.max_length = max_length

    def __call__(self, n):
        return _padded(n, self.max_length)

    def build(self, n):
        return _padded(n, self.max_length)


def _key(make_batch):
    torch.manual_seed(0)
    model = nn.Embedding(50, 8)
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: m(b).float().mean(), make_batch)
    return key_of(probe_cache.key_components(step, device="cpu", capacity=2**25, memory_limit=2**25, probe={}))


def test_make_batchs_code_and_values_are_in_the_key():
    """Every form a make_batch takes (a lambda over a value, a partial, a callable object, a
    bound method) keys its max_length; built again, each keys the same."""
    def closing(max_length):
        return lambda n: _padded(n, max_length)

    def defaulting(max_length):
        return lambda n, length=max_length: _padded(n, length)

    forms = [closing, defaulting, lambda m: functools.partial(_padded, max_length=m), _Batches,
             lambda m: _Batches(m).build]
    for form in forms:
        short, long = _key(form(128)), _key(form(512))
        assert short != long
        assert short == _key(form(128))
    assert _key(forms[0](128)) != _key(lambda n: _padded(n, 128) + 0)  # other code: another key


def test_a_make_batch_whose_code_cannot_be_read_still_keys():
    """A builtin (``torch.ones``: C code) is keyed by its name, without raising."""
    assert _key(torch.ones) != _key(torch.zeros)


def test_what_make_batch_memoises_does_not_change_its_key():
    """Batches a make_batch keeps (a dict filled by the probe's trials) are not its code's data:
    the next probe in the process hits."""
    memo = {}

    def make_batch(n):
        if n not in memo:
            memo[n] = _padded(n)
        return memo[n]

    before = _key(make_batch)
    make_batch(64), make_batch(4096)
    assert _key(make_batch) == before


def test_a_make_batch_of_autobatchs_own_objects_keys_no_counters():
    """The make_batch a ``Runner`` plans with closes over the runner: its step count (a resumed
    run) must not make the key miss."""
    class Holder:
        pass

    runner = autobatch.Runner.__new__(autobatch.Runner)
    runner.global_step = 0

    def closing(owner):
        return lambda n: _padded(n) if owner is not None else None

    before = _key(closing(runner))
    runner.global_step = 1000
    assert _key(closing(runner)) == before
    user = Holder()
    user.seq = 128
    mine = _key(closing(user))
    user.seq = 512
    assert _key(closing(user)) != mine  # a user's object: by its public settings
