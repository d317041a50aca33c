"""What a TrainStep is given is checked with one clear message before it fails deep inside: a
make_batch that ignores its size, a loss_fn that returns no scalar loss tensor (a dict or model
output holding one as 'loss' is taken), an optimizer whose step needs a closure (LBFGS); and a
probe puts back the parameters the optimizer trains outside the model."""

import pytest
import torch
import torch.nn.functional as F

import autobatch
from autobatch import find_max_batch


def _linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.Adam(model.parameters())


def _batch(n):
    return torch.randn(n, 8), torch.randint(0, 2, (n,))


@pytest.mark.parametrize("strategy", ["auto", "binary"])
def test_a_make_batch_that_ignores_its_size_is_an_error_not_the_search_ceiling(strategy):
    model, opt = _linear()
    step = autobatch.TrainStep(model, opt, lambda m, b: F.cross_entropy(m(b[0]), b[1]), lambda n: _batch(16))
    with pytest.raises(ValueError, match=r"ignores its batch size.*make_batch\(64\).*shapes \(16, 8\), \(16,\)"):
        find_max_batch(step, device="cpu", memory_limit="1MiB", strategy=strategy, cache=False)


@pytest.mark.parametrize("make_batch", [lambda n: torch.randn(4, n, 8), lambda n: torch.randn(max(n, 2), 8)])
def test_a_batch_that_grows_otherwise_than_in_dim_0_from_1_is_accepted(make_batch):
    """Sequence-first batches (time, batch, features) keep dim 0; a make_batch that pads to two
    samples (for BatchNorm) builds the same batch at 1 and 2, and grows above."""
    model, opt = _linear()
    step = autobatch.TrainStep(model, opt, lambda m, b: m(b).pow(2).mean(), make_batch)
    assert find_max_batch(step, device="cpu", memory_limit="1MiB", strategy="binary", cache=False).batch_size > 2


def test_a_loss_fn_returning_a_tuple_or_a_vector_is_one_clear_error():
    model, opt = _linear()
    pair = autobatch.TrainStep(model, opt, lambda m, b: (F.cross_entropy(m(b[0]), b[1]), 0), _batch)
    with pytest.raises(TypeError, match=r"loss_fn must return the loss as a scalar tensor .*got tuple.*its \[0\]"):
        find_max_batch(pair, device="cpu", memory_limit="1MiB", cache=False)
    vector = autobatch.TrainStep(model, opt, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), _batch)
    with pytest.raises(ValueError, match=r"shape \(4,\), not a scalar loss.*\.mean\(\)"):
        vector(4)
    nothing = autobatch.TrainStep(model, opt, lambda m, b: {"logits": m(b[0])}, _batch)
    with pytest.raises(TypeError, match=r"dict without a loss \(its keys: logits; .*labels"):
        nothing(4)


class Output(dict):
    """A model output as Transformers returns it: a dict whose ``loss`` is also an attribute."""

    def __getattr__(self, name):
        return self[name]


class Holder:
    def __init__(self, loss):
        self.loss, self.logits = loss, None


@pytest.mark.parametrize("wrap", [lambda loss: {"loss": loss, "extra": 1}, lambda loss: Output(loss=loss), Holder])
def test_a_loss_held_as_loss_in_a_dict_or_model_output_is_taken(wrap):
    scalar = find_max_batch(autobatch.TrainStep(*_linear(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), _batch),
                            device="cpu", memory_limit="1MiB", strategy="binary", cache=False)
    wrapped = autobatch.TrainStep(*_linear(), lambda m, b: wrap(F.cross_entropy(m(b[0]), b[1])), _batch)
    assert find_max_batch(wrapped, device="cpu", memory_limit="1MiB", strategy="binary", cache=False).batch_size == \
        scalar.batch_size


def test_an_optimizer_whose_step_needs_a_closure_is_refused_where_the_step_is_built():
    model = torch.nn.Linear(8, 2)
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match=r"optimizer=LBFGS needs a closure.*not supported"):
        autobatch.TrainStep(model, lbfgs, lambda m, b: m(b).sum(), lambda n: torch.randn(n, 8))
    with pytest.raises(ValueError, match=r"optimizer=LBFGS needs a closure"):
        autobatch.Runner(model, lbfgs, lambda m, b: m(b).sum(), global_batch=4, micro_batch=2, progress=False)


class ClipLoss(torch.nn.Module):
    """A CLIP-style loss that owns a learnable temperature the optimizer trains."""

    def __init__(self):
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.659))

    def forward(self, model, batch):
        a, c = F.normalize(model(batch[0]), dim=-1), F.normalize(model(batch[1]), dim=-1)
        logits, targets = self.logit_scale.exp() * a @ c.T, torch.arange(len(a))
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


@pytest.mark.parametrize("kind", ["loss module", "free parameter"])
def test_parameters_the_optimizer_trains_outside_the_model_are_put_back(kind):
    """With optimizer state already there, the probe copies the weights instead of stepping at
    learning rate 0: it copied only the model's, and the loss's temperature kept the trials' steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    if kind == "loss module":
        loss_fn = ClipLoss()
        extra = list(loss_fn.parameters())
    else:
        temperature = torch.nn.Parameter(torch.tensor(1.5))
        extra = [temperature]

        def loss_fn(m, b):
            return F.mse_loss(m(b[0]) * temperature, m(b[1]))

    opt = torch.optim.Adam(list(model.parameters()) + extra, lr=0.1)

    def make_batch(n):
        return torch.randn(n, 16), torch.randn(n, 16)

    loss_fn(model, make_batch(4)).backward()
    opt.step()
    loss_fn(model, make_batch(4)).backward()  # gradients the user has not stepped yet
    before = [(p.detach().clone(), p.grad.clone()) for p in extra]
    find_max_batch(autobatch.TrainStep(model, opt, loss_fn, make_batch), device="cpu", memory_limit="2MiB", cache=False)
    assert all(torch.equal(p, value) and torch.equal(p.grad, grad) for p, (value, grad) in zip(extra, before))
