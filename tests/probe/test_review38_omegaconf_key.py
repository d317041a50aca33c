"""Review 38: a plain callable's cache key holds the settings its code reads from an OmegaConf config
(a Hydra ``DictConfig``: ``cfg.model.width``, ``cfg["width"]``), as it does from a dict or an object
(``test_review37_plain_cache_paths``): before, neither was seen in a ``DictConfig``, and a wider
config under the same ``cache_key`` was served the narrower one's answer."""

import copy
import functools

import pytest
import torch

from autobatch.probe.caching.cache_key import callable_components

omegaconf = pytest.importorskip("omegaconf")
CFG = omegaconf.OmegaConf.create({"model": {"width": 64, "layers": "${model.depth}", "depth": 2,
                                            "unset": "${oc.env:AUTOBATCH_REVIEW38_UNSET}"}, "shape": [8, 16]})


def _step(batch_size):
    return torch.zeros(batch_size, CFG.model.width * CFG["model"]["layers"], CFG.shape[1])


def test_review38_settings_read_inside_an_omegaconf_config_are_keyed():
    before = callable_components(_step, None)
    assert before["settings"] == {"global CFG.model.width": 64, "global CFG['model']['layers']": 2,
                                  "global CFG.shape[1]": 16}  # the interpolation resolved; `unset` not read
    for path, wider in (("model.width", 512), ("model.depth", 4), ("shape", [8, 32])):
        saved = copy.deepcopy(omegaconf.OmegaConf.select(CFG, path))
        omegaconf.OmegaConf.update(CFG, path, wider)
        assert callable_components(_step, None) != before, path
        omegaconf.OmegaConf.update(CFG, path, saved)
        assert callable_components(_step, None) == before

    class Trainer:
        def __init__(self, width):
            self.cfg = omegaconf.OmegaConf.create({"model": {"width": width}})

        def step(self, batch_size):
            return torch.zeros(batch_size, self.cfg.model.width)

    def by_config(batch_size, conf):
        return torch.zeros(batch_size, conf["model"].width + len(str(conf.model.unset)))

    for make in (lambda w: Trainer(w).step,
                 lambda w: functools.partial(by_config, conf=omegaconf.OmegaConf.create(
                     {"model": {"width": w, "unset": "${oc.env:AUTOBATCH_REVIEW38_UNSET}"}}))):
        assert callable_components(make(64), None) != callable_components(make(512), None)
        assert callable_components(make(64), None) == callable_components(make(64), None)  # an unresolved one: not keyed
