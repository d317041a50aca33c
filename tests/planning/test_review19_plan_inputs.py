"""Saved plans and checkpoint targets as a user writes them.

``Plan.from_dict`` took micro-batch sizes that ``Plan.split`` never cuts: ``[4, 4, 2]`` marked
balanced (split cut 4, 3, 3) and ``[10, 0]`` (two steps reported, one run) passed, while the
sizes the ranks' agreed plan holds (micro-batch 6 of a balanced 10: ``[5, 5]``) were refused.
A checkpoint target that is a class but no ``nn.Module`` (``int``) was "matches no module", as
if a block class were misspelt; a module's name (``"0"``) or a dotted class path
(``"torch.nn.Sequential"``) said nothing of what to pass instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import Plan
from autobatch.planning.checkpointing import find_blocks


def saved(**fields):
    return {"global_batch": 10, "micro_batch": 4, "accumulation_steps": 3, "micro_batch_sizes": [4, 3, 3],
            "checkpointing": False, "balanced": True, **fields}


@pytest.mark.parametrize("fields", [dict(micro_batch_sizes=[4, 4, 2]),  # balanced: split cuts 4, 3, 3
                                    dict(micro_batch=10, accumulation_steps=2, micro_batch_sizes=[10, 0]),
                                    dict(micro_batch=6, accumulation_steps=2, micro_batch_sizes=[6, 4])])
def test_a_loaded_plan_reports_the_split_it_runs(fields):
    with pytest.raises(ValueError, match=r"do not make global_batch=10 in accumulation_steps=\d as split\(\) cuts it .* balanced=True: \["):
        Plan.from_dict(saved(**fields))


def test_a_loaded_plan_of_the_ranks_agreed_micro_batch_loads_and_splits_as_it_says():
    plan = Plan.from_dict(saved(micro_batch=6, accumulation_steps=2, micro_batch_sizes=[5, 5]))
    assert [len(piece) for piece in plan.split(torch.zeros(10, 1))] == plan.micro_batch_sizes == [5, 5]
    unbalanced = Plan.from_dict(saved(balanced=False, micro_batch_sizes=[4, 4, 2]))
    assert [len(piece) for piece in unbalanced.split(torch.zeros(10, 1))] == [4, 4, 2]


@pytest.mark.parametrize("targets, error, said", [
    ([int], TypeError, "int is no nn.Module subclass"),
    (["0"], ValueError, r"'0' is the name of a module of the model, not a class: .*'Sequential'.*modules="),
    (["torch.nn.Sequential"], ValueError, "bare class names, not dotted paths: 'Sequential' for 'torch.nn.Sequential'"),
])
def test_checkpoint_targets_that_name_no_block_class_say_what_to_pass(targets, error, said):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
    with pytest.raises(error, match=said):
        find_blocks(model, targets)


def test_review38_split_takes_a_short_last_batch_and_refuses_a_larger_one():
    """``Plan.split`` cut a batch larger than the plan's global batch into more micro-batches than
    ``accumulation_steps`` without a word (a loop weighting by ``global_batch`` trained another
    batch than planned); a DataLoader's short last batch (``drop_last=False``) still splits."""
    plan = Plan.from_dict(saved())
    assert [len(piece) for piece in plan.split(torch.zeros(7, 1))] == [4, 3]
    with pytest.raises(ValueError, match=r"has 20 samples, more than this plan's global_batch=10 .* at most 10 samples"):
        plan.split({"x": torch.zeros(20, 1), "y": torch.zeros(20)})
