"""An empty cache directory on the command line (an unset shell variable:
``probe.cache_dir=$CACHE``, ``cache clear --dir "$CACHE"``) named the working directory:
``Path("")`` is ``.``, so the probe wrote its entries and lock beside the user's files and
``cache clear`` deleted the entries there. Both are refused, naming what to give instead."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from autobatch.__main__ import main
from autobatch.cli import validation


@pytest.mark.parametrize("action", ["list", "clear"])
def test_cache_command_refuses_an_empty_dir(tmp_path, monkeypatch, capsys, action):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "0123456789abcdef.json").write_text("{}")  # what clear would delete there
    assert main(["cache", action, "--dir", ""]) == 2
    assert "--dir" in capsys.readouterr().err
    assert (tmp_path / "0123456789abcdef.json").exists()


@pytest.mark.parametrize("value", ["", " "])
def test_probe_refuses_an_empty_cache_dir(value):
    cfg = OmegaConf.create({"probe": {"cache": True, "cache_dir": value}})
    with pytest.raises(ValueError, match="probe.cache_dir= is empty"):
        validation.check_cache_dir(cfg)
    validation.check_cache_dir(OmegaConf.create({"probe": {"cache": False, "cache_dir": value}}))
