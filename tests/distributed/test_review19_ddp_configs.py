"""Two CPU ranks (gloo): DDP options that send a model through the runner's local-module step.

A DDP with ``find_unused_parameters=True`` (or ``static_graph``, a comm hook, mixed precision)
trains through its local module with one agreed all-reduce after backward
(``autobatch.dist.step``). Two of the user's DDP options were silently dropped there:

* ``broadcast_buffers=False``: every rank's buffers (BatchNorm statistics) were overwritten with
  rank 0's after every step and at the start of every ``fit()`` call, which DDP never does with
  that option (detection codebases set ``find_unused_parameters=True, broadcast_buffers=False``
  together). Now the runner broadcasts what DDP would (``autobatch.dist.step.forward_synced_buffers``).
* A communication hook of the user's (``fp16_compress_hook``): not applied (the gradients are
  all-reduced once in their own dtype), without a word. Now ``Runner(...)`` warns, naming it.

The scenario runs in ``test_review15b_ddp_unused.py``'s launch (``review15b_worker.py``).
"""

from __future__ import annotations

import pytest
import torch

from test_review15b_ddp_unused import launched  # noqa: F401 - the shared launch's fixture

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(scope="module")
def runs(launched):  # noqa: F811
    return launched["local_configs"]


def test_broadcast_buffers_false_keeps_each_ranks_buffers_through_the_local_module(runs):
    for report in runs:
        assert report["broadcast"]["same_buffers"], report  # DDP's default: rank 0's, after each step
        assert not report["own"]["same_buffers"], report  # before: rank 0's on every rank, at every step
        assert not report["own"]["same_after_refit"], report  # before: rank 0's at every fit() call's start


def test_a_user_comm_hook_the_local_module_step_drops_is_warned_about(runs):
    for report in runs:
        hook = [line for line in report["hook"]["warnings"] if "fp16_compress_hook" in line]
        assert len(hook) == 1 and "not applied" in hook[0], report["hook"]
        assert not any("communication hook" in line for line in report["broadcast"]["warnings"]), report
