"""A resume warns where the checkpoint's optimizer settings replace the run's, not where a
scheduler moved them.

With ``OneCycleLR`` (or ``CyclicLR``) cycling the momentum, every resume warned "the
checkpoint's optimizer settings replace this run's: betas (0.936..., 0.999) (this run: (0.95,
0.999)); set them after resuming to change them": the scheduler's own value, and advice that
would have broken the exact resume.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import autobatch

DATA = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]


def train(checkpoint_dir, *, weight_decay: float = 0.01, resume=None) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=10)
    runner = autobatch.Runner(model, optimizer, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), global_batch=4,
                              micro_batch=2, scheduler=scheduler, checkpoint_dir=checkpoint_dir, progress=False)
    runner.fit(DATA, resume=resume, epochs=2 if resume else 1)


def test_a_cycled_momentum_is_not_warned_about_and_a_changed_setting_is(tmp_path, caplog):
    train(tmp_path)
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        train(tmp_path, resume=tmp_path)
    assert "replace this run's" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        train(tmp_path, weight_decay=0.1, resume=tmp_path)
    assert "replace this run's: weight_decay 0.01 (this run: 0.1)" in caplog.text
    assert "betas" not in caplog.text
