"""``runner.save(directory)`` writes the directory's ``last.pt``, which ``fit(resume=directory)`` reads.

``fit(resume=)`` takes a checkpoint file or the directory holding ``last.pt``, but ``save()``
given a directory wrote its temporary file beside it and then failed to ``os.replace`` it over
the directory (``IsADirectoryError``): the checkpoint a SIGTERM handler meant to write was lost.
"""

from __future__ import annotations

import torch

from autobatch import Runner
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights


def _runner() -> Runner:
    model = make_model()
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                  progress=False, log_every=None)


def test_save_to_a_directory_writes_its_last_pt_and_resumes(tmp_path):
    runner = _runner()
    runner.fit(make_data(), steps=2)
    written = runner.save(tmp_path)
    assert written == tmp_path / "last.pt" and written.is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.pt"]  # no temporary file left beside it
    resumed = _runner()
    resumed.fit(make_data(), steps=2, resume=tmp_path)
    assert resumed.step == 2
    assert_weights_close(weights(resumed.model), weights(runner.model))


def test_review37_save_to_checkpoint_dir_not_made_yet_writes_its_last_pt(tmp_path):
    """``runner.save(runner.checkpoint_dir)`` (from ``on_step_end``) before the run's first save made the
    folder, or ``save("best/")``: a folder's ``last.pt``, not a file named like the folder, over which
    every later save of the run failed with ``FileExistsError``."""
    model = make_model()
    runner = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=8,
                    progress=False, log_every=None, checkpoint_dir=tmp_path / "run", checkpoint_every=2)
    runner.fit(make_data(), steps=3, on_step_end=lambda info: info["step"] == 1 and runner.save(tmp_path / "run"))
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["last.pt"]
    assert runner.save(f"{tmp_path}/best/") == tmp_path / "best" / "last.pt"
