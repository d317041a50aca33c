"""A resume on a runner that trained before takes a fresh step-guard snapshot.

The optimizer step's snapshot is taken once per global step, keyed by the step's index. A runner
that had trained step 2 and was then resumed from a checkpoint at step 2 (another run's, or a
roll-back to a checkpoint of another branch) kept the snapshot of its own step 2: an OOM inside
the resumed step's optimizer step then "undid" it by writing back the weights and optimizer
state from before the resume, and the run went on from them.
"""

from __future__ import annotations

import torch

from autobatch import Runner
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights


def _runner(seed: int, **options) -> Runner:
    model = make_model(seed=seed)
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), mse, global_batch=16,
                  micro_batch=8, grow_after=None, progress=False, log_every=None, **options)


def _oom_after_the_update(runner: Runner, step: int) -> None:
    """A real OOM raised once after ``optimizer.step()`` applied the update of global step ``step``."""
    fired = []

    def hook(optimizer, args, kwargs):
        if runner.step == step and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("CUDA out of memory (test: after the update)")

    runner.optimizer.register_step_post_hook(hook)


def test_a_replay_after_a_resume_undoes_to_the_checkpoints_state(tmp_path):
    data = make_data(96)
    _runner(7, checkpoint_dir=tmp_path).fit(data, steps=2)  # the checkpoint: another run's step 2

    fresh = _runner(0)
    _oom_after_the_update(fresh, 2)
    fresh.fit(data, steps=4, resume=tmp_path)

    used = _runner(0)
    used.fit(data, steps=3)  # it trained its own step 2: its snapshot is of that step
    _oom_after_the_update(used, 2)
    used.fit(data, steps=4, resume=tmp_path)
    assert len(used.result.oom_recoveries) == 1
    assert_weights_close(weights(used.model), weights(fresh.model))
