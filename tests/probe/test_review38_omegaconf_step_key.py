"""Review 38: a ``TrainStep``'s key holds the values of an OmegaConf config (a Hydra ``DictConfig``) its
code reads, as it holds a config dict's or dataclass's (``test_a_module_level_config_object_is_keyed_by_its_state``):
before, a config was keyed by its class alone (its values sit in private attributes), so a loss reading
``cfg.loss.chunks``, a ``make_batch`` padding to ``cfg.data.max_length`` or a module reading
``self.cfg.attn.chunks`` was served another config's answer, and any two configs passed as ``cache_key``
shared one key."""

import pytest
import torch

from autobatch import TrainStep
from autobatch.probe.caching.cache_key import step_components, user_key

omegaconf = pytest.importorskip("omegaconf")
CFG = omegaconf.OmegaConf.create({"data": {"max_length": 64, "len": "${data.max_length}"},
                                  "loss": {"chunks": 1, "smooth": False},
                                  "unset": "${oc.env:AUTOBATCH_REVIEW38_UNSET}"})


class Net(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.body = cfg, torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cat([self.body(x)] * self.cfg.model.attn.chunks)


def _make_batch(batch_size):  # pads to the config's length only above two samples: sample batches alike
    return torch.zeros(batch_size, 8 if batch_size <= 2 else CFG.data.len)


def _loss(model, batch):
    out = model(batch)
    return (out + torch.zeros_like(out) if CFG.loss.smooth else out).sum() * CFG["loss"]["chunks"]


def test_review38_a_train_steps_omegaconf_settings_are_keyed():
    def components(chunks=1):
        model = Net(omegaconf.OmegaConf.create({"model": {"attn": {"chunks": chunks}}}))
        return step_components(TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _make_batch))

    before = components()
    assert components() == before  # the unresolved `unset` is left out, not raised
    assert components(chunks=4)["model"] != before["model"]  # a module's config, three levels down
    for path, other, part in (("data.max_length", 512, "make_batch"), ("loss.chunks", 4, "loss_fn"),
                              ("loss.smooth", True, "loss_fn")):
        saved = omegaconf.OmegaConf.select(CFG, path)
        omegaconf.OmegaConf.update(CFG, path, other)
        changed = components()
        omegaconf.OmegaConf.update(CFG, path, saved)
        assert changed["code"][part] != before["code"][part] and changed["inputs"] == before["inputs"], path
        assert components() == before


def test_review38_an_omegaconf_cache_key_is_keyed_by_its_values():
    def key(width, names=("a", "b")):
        return user_key(omegaconf.OmegaConf.create({"model": {"enc": {"dims": [width, {"w": width}]}},
                                                   "names": list(names), "run": "${oc.env:AUTOBATCH_REVIEW38_UNSET}"}))

    assert key(64) == key(64) and key(64) != key(512) and key(64) != key(64, names=("a", "c"))
    assert key(64) == {"model": {"enc": {"dims": [64, {"w": 64}]}}, "names": ["a", "b"]}
