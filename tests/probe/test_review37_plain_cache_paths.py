"""Review 37: a plain callable's cache key holds the settings its code reads inside a config dict
or object (``cfg["width"]``, ``args.seq_len``, ``self.cfg["width"]``), not only those it names:
before, a wider ``cfg["width"]`` under the same ``cache_key`` was served the narrower one's answer
(959 where 314 fits under 4 MiB), and training at it ran out of memory."""

import argparse
import functools

import torch

from autobatch.probe.caching.cache_key import callable_components

CFG = {"width": 64, "model": {"layers": 2}}
STATS = {"calls": 0}
ARGS = argparse.Namespace(seq_len=16)


def _step(batch_size):
    STATS["calls"] += 1  # a counter the step writes: not keyed, or every call would miss
    STATS["last"] = batch_size
    return torch.zeros(batch_size, CFG["width"] * CFG["model"]["layers"], ARGS.seq_len)


def test_review37_settings_read_inside_a_config_are_keyed():
    before = callable_components(_step, None)
    _step(1)
    STATS["calls"] = 7
    assert callable_components(_step, None) == before
    for change in (lambda: CFG.update(width=512), lambda: CFG["model"].update(layers=4),
                   lambda: setattr(ARGS, "seq_len", 64)):
        saved = (dict(CFG), dict(CFG["model"]), ARGS.seq_len)
        change()
        assert callable_components(_step, None) != before
        CFG.update(saved[0]), CFG["model"].update(saved[1]), setattr(ARGS, "seq_len", saved[2])
        assert callable_components(_step, None) == before

    class Trainer:
        def __init__(self, width):
            self.cfg, self.history = {"width": width}, {"steps": 0}

        def step(self, batch_size):
            self.history["steps"] += 1
            return torch.zeros(batch_size, self.cfg["width"])

    def by_config(batch_size, conf):
        return torch.zeros(batch_size, conf["width"])

    def config_first(conf, batch_size):
        return torch.zeros(batch_size, conf["width"])

    def in_closure(conf):
        return lambda batch_size: torch.zeros(batch_size, conf["width"])

    for make in (lambda w: Trainer(w).step, lambda w: functools.partial(by_config, conf={"width": w}),
                 lambda w: functools.partial(config_first, {"width": w}),
                 lambda w: in_closure({"width": w})):
        assert callable_components(make(64), None) != callable_components(make(512), None)
        assert callable_components(make(64), None) == callable_components(make(64), None)
    trainer = Trainer(64)
    before = callable_components(trainer.step, None)
    trainer.step(1)
    assert callable_components(trainer.step, None) == before
