"""The Runner's options as docs/runner.md's table gives them, checked row by row (review 32).

* the table named every keyword-only option of ``Runner`` with the code's default, but left the
  ``balanced, autocast_dtype, no_sync, device, faults`` row's defaults blank and had no row for
  ``scheduler`` and ``grad_scaler``;
* ``autobatch.train(..., max_epochs=3)`` (a Lightning config's key) was "Runner() got an unexpected
  keyword argument 'max_epochs'; it takes model, optimizer, ..." without ``train()``'s own
  ``epochs``, and ``train()`` took no ``on_step_end``, which ``fit()`` does;
* ``checkpoint_dir=5`` was pathlib's "expected str, bytes or os.PathLike object, not int", naming
  no option, and ``checkpoint_dir=""`` wrote ``last.pt`` into the working folder.
"""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch
from conftest import REPO
from runner_workloads import make_data, make_model, mse

import autobatch


def _table_defaults() -> dict[str, object]:
    text = (REPO / "docs" / "runner.md").read_text()
    table = text[text.index("| option | default | meaning |"):].split("\n\n")[0].splitlines()[2:]
    documented = {}
    for line in table:
        names_cell, defaults_cell = line.split(" | ")[:2]
        names = re.findall(r"`(\w+)`", names_cell)
        defaults = [cell.strip().strip("`") for cell in defaults_cell.split(", ")]
        assert len(names) == len(defaults), f"row {names}: defaults {defaults_cell!r}"
        for name, default in zip(names, defaults):
            documented[name] = inspect.Parameter.empty if default == "—" else ast.literal_eval(default)
    return documented


def test_review32_table_defaults_are_the_runners():
    code = {name: p.default for name, p in inspect.signature(autobatch.Runner).parameters.items()
            if p.kind is p.KEYWORD_ONLY}
    assert _table_defaults() == code


def test_review32_train_keywords_are_fits_and_the_runners():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^train\(\) got an unexpected keyword argument 'max_epochs'; did you mean 'epochs'\?$"):
        autobatch.train(model, optimizer, mse, make_data(), global_batch=16, max_epochs=1)
    with pytest.raises(TypeError, match=r"^train\(\) .*'grow_afer'; did you mean 'grow_after'\?$"):
        autobatch.train(model, optimizer, mse, make_data(), global_batch=16, grow_afer=5)
    seen = []
    result = autobatch.train(model, optimizer, mse, make_data(), global_batch=16, micro_batch=8, steps=2,
                             on_step_end=lambda info: seen.append(info["step"]))
    assert (result.steps, seen) == (2, [1, 2])


def test_review36_train_names_itself_and_a_peers_period_keyword():
    """``train()`` without ``global_batch`` was "Runner.__init__() missing ...", a call the user did
    not make; Transformers' ``save_steps`` was "did you mean 'steps'?" (which ends the run there),
    ``save_every`` "did you mean 'log_every'?", ``logging_steps`` a list of every keyword."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^train\(\) missing 1 required keyword-only argument: 'global_batch'$"):
        autobatch.train(model, optimizer, mse, make_data(), steps=1)
    for key, meant in (("save_steps", "checkpoint_every"), ("save_every", "checkpoint_every"), ("logging_steps", "log_every")):
        with pytest.raises(TypeError, match=rf"'{key}'; did you mean '{meant}'\?$"):
            autobatch.train(model, optimizer, mse, make_data(), global_batch=16, **{key: 10})


def test_review32_checkpoint_dir_of_another_kind():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^checkpoint_dir must be a folder's path .* got int 5; e\.g\. checkpoint_dir="):
        autobatch.Runner(model, optimizer, mse, global_batch=16, checkpoint_dir=5)
    with pytest.raises(ValueError, match=r"^checkpoint_dir='' names no folder"):
        autobatch.Runner(model, optimizer, mse, global_batch=16, checkpoint_dir="")
