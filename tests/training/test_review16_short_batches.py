"""A DataLoader's short last batch (``drop_last=False``), a resume at a smaller given micro-batch,
the progress total of a run bounded by both ``epochs`` and ``steps``, and two claims of
docs/runner.md (class weights made per sample; two dropout layers follow the split on the CPU).

A grow-back try on the short last batch "held" (the batch ran as the same one piece at either
size), so the next epoch's first full batch ran out of memory at the grown size: a plain
recovery that did not double the wait, one more OOM every epoch. A halving recovery on a short
batch replayed the same piece (3 samples at micro-batch 8, then at 4) to fail again. A resume
with ``Runner(micro_batch=2)`` trained at the checkpoint's micro-batch of 4, above the ceiling
its grow-back keeps. ``fit(epochs=1, steps=100)`` over 3 batches logged ``step 1/100``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from autobatch import FaultInjector, Runner
from runner_workloads import assert_weights_close, make_data, make_model, mse, weights


def _limited(limit: int, sizes: list[int] | None = None):
    """``mse`` that runs out of memory on any micro-batch above ``limit`` samples, as a device would."""
    def loss_fn(model, batch):
        if sizes is not None:
            sizes.append(batch[0].shape[0])
        if batch[0].shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return mse(model, batch)
    return loss_fn


def _runner(loss_fn=mse, model=None, **options) -> Runner:
    model = model if model is not None else make_model()
    options = {"global_batch": 8, "progress": False, "log_every": None, **options}
    return Runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, **options)


def test_grow_back_waits_for_a_full_batch_so_it_does_not_fail_every_epoch():
    data = make_data(samples=19, global_batch=8)  # 8, 8 and a short 3
    runner = _runner(_limited(4), micro_batch=4, max_micro_batch=8, grow_after=2)
    result = runner.fit(data, epochs=7)
    # every try at 8 fails, on a full batch, each doubling the wait (2, 4, 8): none "held" on the short batch
    assert [(g["step"], g["held"]) for g in result.grow_attempts] == [(3, False), (9, False), (18, False)]
    assert [r["action"] for r in result.oom_recoveries] == ["back"] * 3
    assert result.samples == 19 * 7


def test_a_halving_recovery_on_a_short_batch_cuts_below_its_one_piece():
    sizes: list[int] = []

    def long_last_batch(model, batch):  # the short last batch holds the long sequences: above 2 samples, no room
        sizes.append(len(batch[2]))
        if batch[2][0] >= 16 and len(batch[2]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return mse(model, batch)

    model, reference, data = make_model(), make_model(), make_data(samples=19, global_batch=8)
    result = _runner(long_last_batch, model=model, micro_batch=8, grow_after=None).fit(data)
    _runner(model=reference, micro_batch=1).fit(data)
    assert sizes == [8, 8, 3, 2, 1]  # not 3 again at micro-batch 4, to fail again
    assert [(r["micro_batch_before"], r["micro_batch"]) for r in result.oom_recoveries] == [(8, 2)]
    assert_weights_close(weights(model), weights(reference))


def test_a_resume_trains_at_most_the_micro_batch_its_runner_was_given(tmp_path):
    data = make_data(samples=32, global_batch=8)
    _runner(micro_batch=4, checkpoint_dir=tmp_path).fit(data, steps=2)
    sizes: list[int] = []
    resumed = _runner(_limited(8, sizes), micro_batch=2, checkpoint_dir=tmp_path)
    result = resumed.fit(data, resume=tmp_path)
    assert set(sizes) == {2} and result.micro_batch == 2 and result.steps == 4


def test_the_progress_total_is_what_ends_the_run_first(caplog):
    runner = _runner(micro_batch=8, log_every=1)
    with caplog.at_level(logging.INFO, logger="autobatch"):
        runner.fit(make_data(samples=24, global_batch=8), epochs=1, steps=100)
    assert "step 3/3 " in caplog.text and "/100" not in caplog.text


def test_grow_back_still_tries_where_every_batch_is_smaller_than_the_global_batch():
    """A loader whose batches all hold 6 samples under global_batch=8 (a warning says so) grows."""
    data = [batch[:2] for batch in make_data(samples=18, global_batch=6)]
    result = _runner(micro_batch=2, max_micro_batch=8, grow_after=1).fit(data)
    assert [(g["step"], g["to"], g["held"]) for g in result.grow_attempts] == [(1, 4, True)]


def test_class_weights_given_per_sample_as_docs_runner_says_train_as_one_batch():
    """``cross_entropy(weight=w)`` divides by the batch's summed weights: split, it moved the
    step; the per-sample tensor ``B * w[y] / w[y].sum()`` from the collate makes it exact."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=generator)
    w = torch.tensor([1.0, 5.0, 10.0], dtype=torch.float64)
    batch = (x, y, 16 * w[y] / w[y].sum())

    def weighted(model, b):
        return (nn.functional.cross_entropy(model(b[0]), b[1], reduction="none") * b[2]).mean()

    def fitted(micro_batch):
        torch.manual_seed(0)
        model = nn.Linear(6, 3).double()
        _runner(weighted, model=model, global_batch=16, micro_batch=micro_batch).fit([batch])
        return weights(model)

    one = fitted(16)
    assert_weights_close(fitted(5), one)
    torch.manual_seed(0)
    model = nn.Linear(6, 3).double()
    nn.functional.cross_entropy(model(x), y, weight=w).backward()
    assert_weights_close([p.detach() - 0.1 * p.grad for p in model.parameters()], one)


def test_two_dropout_layers_on_the_cpu_replay_as_the_smaller_split_trains_as_docs_runner_says():
    """The masks of two dropout layers follow the split on the CPU too: a replay at 4 ends as a
    run at 4 from the step's start did (bit-equal), not as the uninjected run at 8."""
    def fitted(micro_batch, faults=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1)).double()
        torch.manual_seed(1)
        _runner(model=model, micro_batch=micro_batch, faults=faults).fit(make_data(samples=8, global_batch=8))
        return weights(model)

    replayed = fitted(8, FaultInjector([(0, "backward")]))
    assert all(torch.equal(a, b) for a, b in zip(replayed, fitted(4)))
    assert not all(torch.equal(a, b) for a, b in zip(replayed, fitted(8)))
