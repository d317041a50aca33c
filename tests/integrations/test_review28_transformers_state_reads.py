"""A resume reads the checkpoint's ``trainer_state.json`` once: ``fit_batch_size`` parsed it three
times or more (the per-device batch, the split record, its accumulation, and again for the batch
``tell_size`` reports), each read able to see another file if a run was saving beside it. The
probe is stubbed (it answers 2): what is under test is how the checkpoint is read."""

from __future__ import annotations

import builtins
import json

import pytest

transformers = pytest.importorskip("transformers")

import autobatch.integrations.transformers as transformers_integration  # noqa: E402
from autobatch.integrations.transformers import fit_batch_size  # noqa: E402
from autobatch.integrations.transformers_resume import STATE_NAME, saved_split  # noqa: E402

from test_review26_transformers_resume_record import _trainer  # noqa: E402  a tiny GPT-2 Trainer


def _fit(step, **options):
    from autobatch import ProbeResult

    return ProbeResult(batch_size=2, strategy="auto", strategy_used="binary", trials=[], capacity_bytes=None,
                       elapsed_s=0.0, margin=0.0)


def _checkpoint(folder, record: dict | None) -> str:
    """A checkpoint folder whose state says 4 a device at step 3, with ``record`` as its split record."""
    folder.mkdir()
    state = {"global_step": 3, "train_batch_size": 4, "stateful_callbacks": {}}
    if record is not None:
        state["stateful_callbacks"]["AutobatchSplit"] = {"args": record, "attributes": {}}
    (folder / STATE_NAME).write_text(json.dumps(state))
    return str(folder)


def test_a_resume_reads_trainer_state_once_and_keeps_its_samples_per_step(tmp_path, monkeypatch):
    monkeypatch.setattr(transformers_integration, "find_max_batch", _fit)
    path = _checkpoint(tmp_path / "checkpoint-3", {"gradient_accumulation_steps": 4, "train_batch_size": 4,
                                                   "global_step": 3})
    trainer = _trainer(tmp_path, max_steps=4)
    opened, real_open = [], builtins.open

    def counting_open(file, *args, **kwargs):
        opened.append(str(file)) if str(file).endswith(STATE_NAME) else None
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    fit_batch_size(trainer, resume_from_checkpoint=path)
    assert len(opened) == 1, opened
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 8)  # 16 kept


def test_saved_split_of_a_record_from_an_earlier_run(tmp_path):
    path = _checkpoint(tmp_path / "checkpoint-3", {"gradient_accumulation_steps": 4, "train_batch_size": 8,
                                                   "global_step": 1})
    saved = saved_split(path)  # the record is step 1's, carried over: not this checkpoint's split
    assert (saved.batch, saved.accumulation, saved.stale_step) == (4, None, 1)
