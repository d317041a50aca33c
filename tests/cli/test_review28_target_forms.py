"""A ``_target_`` typed as a Hydra user types it: quoted once more than the shell and Hydra take
off (``model._target_='"mymodels.Net"'``), spaced, an entry point's ``module:Name``, or a call
(``'model._target_="mymodels.Net()"'``). Each failed as "no module named ``'"mymodels``" (or "has
no attribute"), which did not say the path was right and its spelling was not; each is now one
message naming what to type. The forms Hydra reads as the path itself (one pair of quotes, the
path inside a quoted dict) still build. Composed as the command line's overrides (docs/cli.md)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import validate

CPU = ["device=cpu", "probe.cache=false", "probe.max_batch=2", "optimizer=target"]


@pytest.fixture(scope="module")
def composed():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        yield lambda *overrides: compose("probe", overrides=[*CPU, *overrides])


def _refused(composed, override: str, typed: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate(composed(override))
    message = str(caught.value)
    assert message.startswith(f"optimizer._target_={typed} is no import path") and "\n" not in message
    assert message.endswith("give optimizer._target_=torch.optim.SGD"), message


def test_a_quoted_or_spaced_target_names_the_path_to_type(composed):
    _refused(composed, """optimizer._target_='"torch.optim.SGD"'""", "'\"torch.optim.SGD\"'")
    _refused(composed, """optimizer._target_="' torch.optim.SGD'\"""", "\"' torch.optim.SGD'\"")
    _refused(composed, """optimizer={_target_: '"torch.optim.SGD"'}""", "'\"torch.optim.SGD\"'")


def test_an_entry_point_or_a_call_names_the_path_and_the_paths_own_forms_build(composed):
    _refused(composed, "optimizer._target_=torch.optim:SGD", "'torch.optim:SGD'")
    _refused(composed, """optimizer._target_='torch.optim.SGD()'""", "'torch.optim.SGD()'")
    cfg = composed("""optimizer={_target_: "torch.optim.SGD"}""")  # one pair of quotes: Hydra's, taken off
    assert cfg.optimizer._target_ == "torch.optim.SGD"
    validate(cfg)
