"""A resumed run trains the split its checkpoint's run trained, at a size the batch can take.

A planned run with ``plan_options={"multiple_of": 8}`` trains the plan's split (full pieces
that are multiples of 8, a smaller last one: ``balanced=False``), but a resume does not plan
again and the split policy was in no checkpoint: the resumed run went back to the
``Runner``'s default balanced split (104 x 9 + 64 became 10 x 100), pieces that are no
multiple of 8 and another summation order than the uninterrupted run's. A checkpoint's
micro-batch was also taken above this run's batch (resumed with a smaller ``global_batch``),
so the runner reported, and halved from, a size its batches never had.
"""

from __future__ import annotations

import torch
from torch import nn

from autobatch import Runner
from autobatch.training.checkpoints.checkpoint_io import load_checkpoint
from runner_workloads import make_data, make_model, mse


def _planned(model: nn.Module, sizes: list[int], **options) -> Runner:
    def loss_fn(m, batch):
        sizes.append(batch[0].shape[0])
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    plan = {"memory_limit": "1500KiB", "strategy": "binary", "multiple_of": 8, "cache": False}
    options = {"global_batch": 1000, "micro_batch": None, "grow_after": None, "plan_options": plan,
               "progress": False, "log_every": None, **options}
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, **options)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def test_a_resumed_planned_run_trains_the_plans_split(tmp_path):
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(1000, 32, generator=generator), torch.randint(0, 10, (1000,), generator=generator))
            for _ in range(2)]
    first_sizes: list[int] = []
    first = _planned(_model(), first_sizes, checkpoint_dir=tmp_path)
    first.fit(data, steps=1)
    planned = first.result.plan["micro_batch_sizes"]
    assert not first.balanced and all(size % 8 == 0 for size in planned[:-1])

    resumed_sizes: list[int] = []
    resumed = _planned(_model(), resumed_sizes)
    resumed.fit(data, steps=2, resume=tmp_path)
    assert resumed_sizes == planned  # the plan's split, as the uninterrupted run's second step
    assert not resumed.balanced


def test_a_given_split_policy_is_kept_on_resume(tmp_path):
    """A runner given its micro-batch keeps its own ``balanced`` (nothing was planned)."""
    def _runner(**options) -> Runner:
        model = make_model()
        return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=6,
                      progress=False, log_every=None, **options)

    _runner(checkpoint_dir=tmp_path).fit(make_data(), steps=1)
    resumed = _runner(balanced=False)
    resumed.fit(make_data(), steps=2, resume=tmp_path)
    assert resumed.balanced is False


def test_a_checkpoints_micro_batch_above_this_runs_batch_is_cut_to_it(tmp_path):
    model = make_model()
    Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=32, micro_batch=32,
           checkpoint_dir=tmp_path, progress=False, log_every=None).fit(make_data(64, 32), steps=1)
    assert load_checkpoint(tmp_path)["micro_batch"] == 32
    model = make_model()
    resumed = Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse, global_batch=16, micro_batch=16,
                     progress=False, log_every=None)
    result = resumed.fit(make_data(64, 16), steps=2, resume=tmp_path)
    assert resumed.micro_batch == 16 and result.micro_batch == 16
