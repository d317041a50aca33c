"""Steps the probe's authors had not tried (review 19): a GAN's plain callable whose second
optimizer ``restore`` does not name, a sparse embedding's step, a compiled model on the CPU's
simulated device. Each probe said nothing of what it could not promise; now a warning or a note
says what to change."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autobatch
from autobatch.probe.content_peaks import sparse_note


def _gan():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16))
    disc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())

    def step(n: int) -> None:
        fake = gen(torch.randn(n, 8))
        opt_d.zero_grad()
        real = nn.functional.softplus(-disc(torch.randn(n, 16))).mean()
        (real + nn.functional.softplus(disc(fake.detach())).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        nn.functional.softplus(-disc(fake)).mean().backward()
        opt_g.step()

    return gen, disc, opt_g, opt_d, step


def test_a_second_optimizer_restore_does_not_hold_is_named_and_one_it_holds_is_put_back():
    gen, disc, opt_g, opt_d, step = _gan()
    named = r"stepped an optimizer that restore does not hold \(Adam\).*restore=\(model, optimizer, other_model"
    with pytest.warns(RuntimeWarning, match=named):
        autobatch.find_max_batch(step, memory_limit="256KiB", restore=(gen, opt_g))
    assert opt_d.state  # the warning's reason: the discriminator's optimizer kept the trials' steps
    weights, moments = [p.clone() for p in disc.parameters()], [s["exp_avg"].clone() for s in opt_d.state.values()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything put back: no warning
        result = autobatch.find_max_batch(step, memory_limit="256KiB", restore=(gen, opt_g, disc, opt_d))
    assert all(torch.equal(a, b) for a, b in zip(weights, disc.parameters()))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, opt_d.state.values()))
    with autobatch.simulated_memory("256KiB"):  # the answer trains on under the same cap
        for _ in range(4):
            step(result.batch_size)


class _Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.tokens, self.head = nn.Embedding(2000, 32, sparse=sparse), nn.Linear(32, 4)

    def forward(self, ids):
        return self.head(self.tokens(ids).mean(1))


def test_a_step_with_sparse_gradients_is_told_its_answer_depends_on_the_rows_it_touches():
    """A SparseAdam embedding's answer sat at 99.6 % of an 8 MiB budget, its steps' peaks 0.7 %
    apart (under content_note's 1 %, so no note), and training at it ran out of memory at its first
    step. An SGD step on the same sparse gradients shows no spread at all in its trials."""
    torch.manual_seed(0)
    model = _Bag(sparse=True)
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                               lambda n: (torch.randint(0, 2000, (n, 16)), torch.randint(0, 4, (n,))))
    result = autobatch.find_max_batch(step, memory_limit="2MiB", cache=False)
    assert any(note.startswith("tokens has sparse gradients") and "margin=" in note for note in result.notes)
    assert sparse_note(_Bag(sparse=False), (None, step.optimizer), 8) is None  # dense: no note
    assert "SparseAdam" in sparse_note(None, (None, torch.optim.SparseAdam(model.tokens.parameters())), 8)


def test_a_compiled_model_on_the_simulated_device_is_said_to_run_eager():
    model = torch.compile(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8)))
    step = autobatch.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               lambda m, b: nn.functional.mse_loss(m(b), b), lambda n: torch.randn(n, 8))
    result = autobatch.find_max_batch(step, memory_limit="1MiB", cache=False, max_batch=512)
    assert any("does not compile under the simulated device" in note for note in result.notes)
    plain = autobatch.find_max_batch(lambda n: model(torch.randn(n, 8)).sum().backward(), memory_limit="1MiB",
                                     restore=(model, step.optimizer), max_batch=512)
    assert any("uncompiled code" in note for note in plain.notes)


class _SparseCritic(nn.Module):
    """A loss module (``loss_fn=criterion``) adding a per-class bias looked up in a ``sparse=True`` table it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(50, 4, sparse=True)

    def forward(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]) + self.table(batch[1]), batch[1] % 4)


def test_review35_sparse_momentum_in_the_loss_module_is_noted():
    """SGD's momentum on a sparse embedding grows every step: the probe's note looked at ``restore``'s
    modules (a TrainStep's model and optimizer), so one in the step's loss module got no note."""
    torch.manual_seed(0)
    model, critic = nn.Linear(8, 4), _SparseCritic()
    step = autobatch.TrainStep(model, torch.optim.SGD([*model.parameters(), *critic.parameters()], lr=0.1, momentum=0.9),
                               critic, lambda n: (torch.randn(n, 8), torch.randint(0, 50, (n,))))
    result = autobatch.find_max_batch(step, strategy="binary", memory_limit="64MiB", max_batch=8, cache=False)
    assert any("trains 'loss_fn.table', a sparse=True embedding" in note for note in result.notes), result.notes
