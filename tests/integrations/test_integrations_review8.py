"""Review 8 of the integrations: what users of Accelerate's decorator and of Lightning met."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autobatch import find_executable_batch_size, simulated_memory
from autobatch.memory.simulated import host_memory


def _oom_above(limit: int, size: int) -> None:
    if size > limit:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


def test_a_method_gets_the_batch_size_after_its_instance():
    """Accelerate's decorator passes a method's batch size as ``self`` (and the instance as the
    batch size): ``self.limit`` failed on an int. A method gets it after the instance."""

    class Loop:
        limit = 40

        @find_executable_batch_size(starting_batch_size=64)
        def train(self, batch_size, scale, shift=0):
            _oom_above(self.limit, batch_size)
            return batch_size * scale + shift

        @classmethod
        @find_executable_batch_size(starting_batch_size=8)
        def build(cls, batch_size):
            return cls, batch_size

    loop = Loop()
    assert loop.train(2, shift=1) == 81 and Loop.train.batch_size == 40
    assert [a.batch_size for a in Loop.train.attempts][0] == 64 and Loop.train.attempts[-1].ok
    assert Loop.train(loop, 1) == 40  # called through the class with its instance
    assert Loop.build() == (Loop, 8)
    with pytest.raises(TypeError, match=r"first argument.*`train\(scale, shift\)`"):
        loop.train(16, 2, 3)  # the batch size passed too: still Accelerate's guard, without self


def test_a_function_whose_first_parameter_is_the_batch_size_is_unchanged():
    """Only ``self``/``cls`` make a method: a bound method and a plain function get it first."""

    class Model:
        def fit(self, batch_size, epochs):
            return batch_size, epochs

    assert find_executable_batch_size(Model().fit, starting_batch_size=4)(3) == (4, 3)

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size, model):
        return batch_size, model

    assert train("m") == (4, "m")


def test_the_batch_size_passed_by_name_is_one_clear_error():
    """``train(batch_size=32)`` was Python's "got multiple values for argument" only."""

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, model=None):
        return batch_size

    with pytest.raises(TypeError, match=r"by name \(batch_size=32\).*Remove it.*starting_batch_size"):
        train(batch_size=32)
    assert train.attempts == []  # refused before any attempt

    @find_executable_batch_size(starting_batch_size=8)
    def collect(size, **options):  # a keyword the function takes in **options is its own
        return size, options

    assert collect(batch_size=3) == (8, {"batch_size": 3})


def test_a_number_where_the_function_goes_names_starting_batch_size():
    """``@find_executable_batch_size(64)`` said only "decorates a function; got int"."""
    with pytest.raises(TypeError, match=r"starting_batch_size=64"):

        @find_executable_batch_size(64)
        def train(batch_size):
            return batch_size


pl = pytest.importorskip("lightning.pytorch")
from autobatch.integrations.lightning import AutoBatchSize  # noqa: E402

WIDTH = 256


class Gan(pl.LightningModule):
    """Lightning's manual-optimization GAN pattern: each optimizer's step between
    ``toggle_optimizer`` and ``untoggle_optimizer``, which freeze the other's parameters."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        self.critic = nn.Sequential(nn.Linear(1, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        rng = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(512, 8, generator=rng), torch.randn(512, 1, generator=rng))

    def training_step(self, batch, index):
        x, real = batch
        gen_opt, critic_opt = self.optimizers()
        self.toggle_optimizer(gen_opt)
        fake = self.generator(x)
        gen_opt.zero_grad()
        self.manual_backward(self.critic(fake).mean())
        gen_opt.step()
        self.untoggle_optimizer(gen_opt)
        self.toggle_optimizer(critic_opt)
        critic_opt.zero_grad()
        self.manual_backward(self.critic(fake.detach()).mean() - self.critic(real).mean())
        critic_opt.step()
        self.untoggle_optimizer(critic_opt)

    def configure_optimizers(self):
        return torch.optim.Adam(self.generator.parameters(), 1e-3), torch.optim.Adam(self.critic.parameters(), 1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size, drop_last=True)


class Weights(pl.Callback):
    def on_fit_start(self, trainer, module):
        with host_memory():
            self.weights = {k: v.clone() for k, v in module.state_dict().items()}
            self.optimizers = [repr(o.state_dict()) for o in trainer.optimizers]


def test_a_toggled_manual_optimization_step_is_probed_after_an_oom():
    """A trial that ran out of memory between ``toggle_optimizer`` and ``untoggle_optimizer``
    left the critic frozen: the next trial's critic loss had no gradient and the probe ended in
    ``RuntimeError: element 0 of tensors does not require grad``. The flags are put back."""
    module, finder, before, after = Gan(), AutoBatchSize(strategy="binary"), Weights(), Weights()
    with simulated_memory("2MiB") as device:
        pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[before, finder, after]).fit(module)
    assert device.oom_count >= 1 and 1 < finder.batch_size < 512 and module.hparams.batch_size == finder.batch_size
    assert all(p.requires_grad for p in module.parameters())
    assert all(torch.equal(before.weights[k], after.weights[k]) for k in before.weights)
    assert before.optimizers == after.optimizers


@pytest.mark.parametrize("name", [3, "", None])
def test_a_batch_arg_name_that_is_no_attribute_name_is_refused_when_built(name):
    """``AutoBatchSize(batch_arg_name=3)`` was accepted and failed at fit start inside Lightning's
    ``lightning_hasattr`` ("attribute name must be string")."""
    with pytest.raises(TypeError, match="batch_arg_name must name the batch size attribute"):
        AutoBatchSize(batch_arg_name=name)
