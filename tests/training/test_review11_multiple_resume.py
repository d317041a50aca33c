"""``Runner(multiple_of=N)`` across a checkpoint: the checkpoint records N, a resume with the same
N continues exactly (bit-equal to the uninterrupted run), and a resume with another N (or from a
checkpoint of an older version, which has none: 1) keeps this run's N, rounds the checkpoint's
micro-batch down to it, and says so in a warning."""

from __future__ import annotations

import torch

from autobatch import FaultInjector, Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint, save_checkpoint
from runner_workloads import make_data, make_model, weights

GLOBAL = 24


def _runner(sizes: list[int], multiple_of: int = 4, faults=None, **options) -> Runner:
    model = make_model()

    def loss_fn(m, batch):
        sizes.append(int(batch[0].shape[0]))
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    options = {"global_batch": GLOBAL, "micro_batch": GLOBAL, "grow_after": None, "progress": False,
               "log_every": None, **options}
    return Runner(model, torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn, multiple_of=multiple_of,
                  faults=faults, **options)


def test_a_resume_with_the_same_multiple_continues_bit_equal(tmp_path):
    faults = [(1, "backward")]  # 24 -> 12
    whole_sizes: list[int] = []
    whole = _runner(whole_sizes, faults=FaultInjector(faults))
    whole.fit(make_data(96, GLOBAL), epochs=2)

    first_sizes: list[int] = []
    _runner(first_sizes, faults=FaultInjector(faults), checkpoint_dir=tmp_path).fit(make_data(96, GLOBAL), steps=3)
    saved = load_checkpoint(tmp_path)
    assert saved["multiple_of"] == 4 and saved["micro_batch"] == 12
    resumed_sizes: list[int] = []
    resumed = _runner(resumed_sizes)
    resumed.fit(make_data(96, GLOBAL), epochs=2, resume=tmp_path)
    assert all(size % 4 == 0 for size in first_sizes + resumed_sizes)
    assert resumed_sizes == [12, 12] * 5  # the uninterrupted run's split after its recovery
    for a, b in zip(weights(resumed.model), weights(whole.model), strict=True):
        assert torch.equal(a, b)


def test_a_resume_with_another_multiple_keeps_this_runs_and_warns(tmp_path, caplog):
    sizes: list[int] = []
    _runner(sizes, micro_batch=12, checkpoint_dir=tmp_path).fit(make_data(96, GLOBAL), steps=1)
    resumed_sizes: list[int] = []
    resumed = _runner(resumed_sizes, multiple_of=8)
    with caplog.at_level("WARNING", logger="autobatch"):
        resumed.fit(make_data(96, GLOBAL), steps=3, resume=tmp_path)
    assert "multiples of 4" in caplog.text and "multiples of 8" in caplog.text and "multiple_of=4" in caplog.text
    assert resumed.micro_batch == 8 and resumed_sizes == [8, 8, 8] * 2  # 12 rounded down to this run's multiple


def test_an_older_checkpoint_without_the_key_resumes_as_multiple_of_one(tmp_path, caplog):
    sizes: list[int] = []
    _runner(sizes, multiple_of=1, micro_batch=6, checkpoint_dir=tmp_path).fit(make_data(96, GLOBAL), steps=1)
    state = load_checkpoint(tmp_path)
    del state["multiple_of"]  # as a checkpoint of an earlier version
    save_checkpoint(state, tmp_path / "last.pt")
    same: list[int] = []
    with caplog.at_level("WARNING", logger="autobatch"):
        _runner(same, multiple_of=1, micro_batch=6).fit(make_data(96, GLOBAL), steps=2, resume=tmp_path)
    assert same == [6] * 4 and "multiples of" not in caplog.text  # 1, as the run had
    resumed_sizes: list[int] = []
    with caplog.at_level("WARNING", logger="autobatch"):
        resumed = _runner(resumed_sizes, micro_batch=4).fit(make_data(96, GLOBAL), steps=2, resume=tmp_path)
    assert "multiples of 1" in caplog.text and resumed.micro_batch == 4 and resumed_sizes == [4] * 6
