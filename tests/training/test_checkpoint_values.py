"""What a runner checkpoint holds: the parameters the optimizer trains outside the model (a
loss module's), and only values its own weights-only loader reads back."""

from __future__ import annotations

import enum
import io
import logging

import numpy as np
import pytest
import torch
from torch import nn

from autobatch import CheckpointError, Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint, save_checkpoint
from autobatch.training.checkpoints.checkpoint_values import storable
from runner_workloads import make_data, make_model, mse


class ClipLoss(nn.Module):
    """A CLIP-style loss: its temperature is a parameter the optimizer trains, in no model."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.659, dtype=torch.float64))

    def forward(self, model, batch):
        out = model(batch[0])
        return nn.functional.mse_loss(out * self.logit_scale.exp(), batch[1] * 10)


def _setup(lr: float = 0.05):
    model, loss = make_model(), ClipLoss()
    optimizer = torch.optim.Adam([{"params": list(model.parameters())}, {"params": [loss.logit_scale], "lr": lr}], lr=0.01)
    return model, loss, optimizer


def _runner(model, loss, optimizer, **options):
    return Runner(model, optimizer, loss, global_batch=16, micro_batch=8, progress=False, grow_after=None, **options)


def test_parameters_trained_outside_the_model_resume_exactly(tmp_path):
    """Only model.state_dict() was saved: the loss's logit_scale resumed at its initial value and
    the resumed run diverged silently (2.5916 against 2.4756 uninterrupted)."""
    data = make_data(96)
    model, loss, optimizer = _setup()
    _runner(model, loss, optimizer).fit(data, epochs=1)
    model2, loss2, optimizer2 = _setup()
    _runner(model2, loss2, optimizer2, checkpoint_dir=tmp_path).fit(data, steps=3)
    model3, loss3, optimizer3 = _setup()
    _runner(model3, loss3, optimizer3).fit(data, epochs=1, resume=tmp_path)
    assert loss3.logit_scale.item() == loss.logit_scale.item() != 2.659
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model3.parameters()))
    assert set(load_checkpoint(tmp_path)["loose_parameters"]) == {"1.0"}  # group 1, index 0


def test_a_checkpoint_without_them_still_resumes_with_a_warning(tmp_path, caplog):
    model, loss, optimizer = _setup()
    _runner(model, loss, optimizer, checkpoint_dir=tmp_path).fit(make_data(), steps=2)
    state = load_checkpoint(tmp_path)
    del state["loose_parameters"]  # as an earlier version wrote it
    save_checkpoint(state, tmp_path / "old.pt")
    model2, loss2, optimizer2 = _setup()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        result = _runner(model2, loss2, optimizer2).fit(make_data(), steps=3, resume=tmp_path / "old.pt")
    assert result.steps == 3
    assert "not the 1 the optimizer trains outside it (optimizer group.index 1.0" in caplog.text


def test_loose_parameters_of_another_shape_are_one_checkpoint_error(tmp_path):
    model, loss, optimizer = _setup()
    _runner(model, loss, optimizer, checkpoint_dir=tmp_path).fit(make_data(), steps=1)
    model2 = make_model()
    wider = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer2 = torch.optim.Adam([{"params": list(model2.parameters())}, {"params": [wider]}])
    state = load_checkpoint(tmp_path)
    state["optimizer"]["state"].pop(max(state["optimizer"]["state"]))  # its Adam moments would refuse first
    save_checkpoint(state, tmp_path / "cut.pt")
    with pytest.raises(CheckpointError, match=r"group.index 1.0 .* has shape \(\) and this run's \(2,\)"):
        _runner(model2, lambda m, b: mse(m, b) + wider.sum(), optimizer2).fit(make_data(), steps=2,
                                                                            resume=tmp_path / "cut.pt")


def test_a_numpy_learning_rate_is_saved_as_the_python_number(tmp_path):
    """SGD(lr=np.float64(...)) wrote a checkpoint the runner's own weights-only loader refused."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=np.float64(0.01) * 2, momentum=np.float32(0.9))
    Runner(model, optimizer, mse, global_batch=16, micro_batch=16, progress=False, checkpoint_dir=tmp_path).fit(
        make_data(), steps=2)
    group = load_checkpoint(tmp_path)["optimizer"]["param_groups"][0]
    assert type(group["lr"]) is float and group["lr"] == pytest.approx(0.02) and type(group["momentum"]) is float
    model2 = make_model()
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.02, momentum=0.9)
    result = Runner(model2, optimizer2, mse, global_batch=16, micro_batch=16, progress=False).fit(
        make_data(), steps=3, resume=tmp_path)
    assert result.steps == 3
    assert type(optimizer.param_groups[0]["lr"]) is np.float64  # the live optimizer is left as it was


class Colour(enum.Enum):
    RED = 1


@pytest.mark.parametrize("value", [np.array([1.0]), Colour.RED, range(3)], ids=["ndarray", "enum", "range"])
def test_a_value_no_weights_only_load_reads_fails_at_save_naming_it(tmp_path, value):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["tag"] = value
    runner = Runner(model, optimizer, mse, global_batch=16, micro_batch=16, progress=False)
    runner.fit(make_data(), steps=1)
    with pytest.raises(TypeError, match=r"\['optimizer'\]\['param_groups'\]\[0\]\['tag'\] is a .*add_safe_globals"):
        runner.save(tmp_path / "last.pt")
    assert not list(tmp_path.iterdir())  # nothing written, not even a temporary file


def test_storable_values_load_back_with_weights_only():
    state = {"a": [1, 2.5, "x", None, True, 1j, b"b", (np.int64(3), np.float32(0.5), np.bool_(True))],
             "t": torch.ones(2), "p": nn.Parameter(torch.zeros(1)), "s": {1, 2}, "size": torch.Size([2, 3]),
             "d": torch.float16, "dev": torch.device("cpu")}
    kept = storable(state)
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["a"][7] == (3, 0.5, True) and type(loaded["a"][7][0]) is int
    assert kept["t"] is state["t"] and storable(kept) is kept  # tensors never copied; nothing to change: as is


class Tally:
    """A per-class metric keyed as ``np.unique`` gives its labels: numpy integers."""

    def __init__(self) -> None:
        self.counts = {}

    def state_dict(self):
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state):
        self.counts = dict(state["counts"])


def test_review37_numpy_dict_keys_in_extra_state_are_written_as_python_values_and_resume(tmp_path):
    """Only values were converted: a dict keyed by ``np.int64`` was written, and the resume refused the
    runner's own checkpoint as holding "objects that could run code"; an unreadable key is refused at save."""
    tally = Tally()
    tally.counts = {label: 0.5 for label in np.unique(np.array([3, 1, 3]))}
    model = make_model()
    Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=16, progress=False,
           checkpoint_dir=tmp_path, extra_state={"tally": tally}).fit(make_data(), steps=1)
    resumed, model2 = Tally(), make_model()
    Runner(model2, torch.optim.SGD(model2.parameters(), lr=0.1), mse, global_batch=16, micro_batch=16, progress=False,
           extra_state={"tally": resumed}).fit(make_data(), steps=2, resume=tmp_path)
    assert resumed.counts == {1: 0.5, 3: 0.5} and all(type(key) is int for key in resumed.counts)
    with pytest.raises(TypeError, match=r"\['m'\]'s key <Colour.RED: 1> is a .*Colour"):
        storable({"m": {Colour.RED: 1}})


def test_review37_an_extra_state_no_checkpoint_holds_is_refused_before_the_first_step(tmp_path):
    """Refused only by the first save: ``checkpoint_every`` steps in, or after the last step where only the end
    saves, and the process exited with every step trained lost. A lazy module's uninitialized weights pass."""
    tally, lazy = Tally(), nn.LazyLinear(2)
    tally.counts = {"kind": Colour.RED}
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=16,
                    progress=False, checkpoint_dir=tmp_path, extra_state={"tally": tally, "lazy": lazy})
    with pytest.raises(TypeError, match=r"\['extra_state'\]\['tally'\]\['counts'\]\['kind'\] is a .*Colour"):
        runner.fit(make_data(), steps=3)
    assert runner.step == 0
    tally.counts = {"kind": 1}
    runner.fit(make_data(), steps=1, on_step_end=lambda info: lazy(torch.zeros(1, 3)))  # materialized before the save
    assert load_checkpoint(tmp_path)["extra_state"]["lazy"]["weight"].shape == (2, 3)
