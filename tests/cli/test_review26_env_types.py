"""An environment variable given to a list key (review 26): ``${oc.env:SHAPE}`` is text, so
``data.shape=${oc.env:SHAPE}`` with ``SHAPE='[4]'`` failed as "data.shape must be positive
integers, got [4]" (it looked like a list), ``optimizer.betas=...`` as "Invalid value assigned:
str is not a ListConfig" with no key, and ``--cfg job --resolve`` as OmegaConf's traceback."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("extra", [(), ("--cfg", "job", "--resolve")])
def test_env_text_for_a_list_names_oc_decode(cli_here, monkeypatch, extra):
    monkeypatch.setenv("REVIEW26_BETAS", "[0.8,0.9]")
    result = cli_here("probe", "optimizer.betas=${oc.env:REVIEW26_BETAS}", *extra)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "Traceback" not in line and line.count("autobatch: error:") == 1
    assert line.startswith("autobatch: error: optimizer.betas=${oc.env:REVIEW26_BETAS} is the text '[0.8,0.9]'")
    assert line.endswith("""'optimizer.betas="${oc.decode:${oc.env:REVIEW26_BETAS}}"'""")


def test_the_named_fix_composes(cli_here, monkeypatch):
    monkeypatch.setenv("REVIEW26_BETAS", "[0.8,0.9]")
    result = cli_here("probe", 'optimizer.betas="${oc.decode:${oc.env:REVIEW26_BETAS}}"', "--cfg", "job",
                      "--resolve", "--package", "optimizer")
    assert result.returncode == 0, result.stderr
    assert "betas:\n- 0.8\n- 0.9" in result.stdout
