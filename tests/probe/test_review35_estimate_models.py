"""Review 35: the probe on models of kinds it was not tuned on. A ``sparse=True`` embedding in the
``TrainStep``'s loss module (``loss_fn=criterion``, whose parameters train with the model's) gets the
sparse-gradient note the model's own gets: the note looked at the model alone, so a probe of such a step
answered with nothing said, where another batch of the same size (touching more rows) can take more."""

import torch
from torch import nn
from torch.nn import functional as F

from autobatch import TrainStep, find_max_batch


class _SparseCritic(nn.Module):
    """A loss module with a per-class bias looked up in a ``sparse=True`` table it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(50, 50, sparse=True)

    def forward(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]) + self.table(batch[1]), batch[1])


def test_review35_probe_notes_sparse_gradients_of_the_loss_module():
    torch.manual_seed(0)
    model, critic = nn.Linear(16, 50), _SparseCritic()
    step = TrainStep(model, torch.optim.SGD([*model.parameters(), *critic.parameters()], lr=0.1), critic,
                     lambda n: (torch.randn(n, 16), torch.randint(0, 50, (n,))))
    result = find_max_batch(step, strategy="binary", memory_limit="64MiB", max_batch=8, cache=False)
    assert result.batch_size == 8
    assert any(note.startswith("loss_fn.table has sparse gradients") for note in result.notes), result.notes
