"""Review 13: the one-line errors say what the user's code raised and where, keep the library's
advice, name a misspelt key of a typed option or of a YAML of the user's own, refuse a model
``_target_`` that is no module, and a sweep's summary lists a job stopped by a signal."""

from __future__ import annotations

import csv
import signal
from types import SimpleNamespace

import pytest
import torch

from autobatch.cli import interrupt, preflight
from autobatch.cli.construct import construct
from autobatch.cli.errors import BAD_INPUT, RUNTIME_FAILURE, CLIError, describe
from autobatch.errors import StepOutOfMemoryError
from autobatch.probe.trial_notes import with_trial_note


def _users_forward(x):
    raise ValueError("shape bug in my model")


def test_a_valueerror_of_the_users_code_is_a_failure_that_says_its_type_and_where():
    """Before: "autobatch: error: shape bug in my model", exit 2 (bad input), no type, no place."""
    try:
        _users_forward(None)
    except ValueError as exc:
        message, code = describe(exc)
    assert code == RUNTIME_FAILURE
    assert message.startswith("ValueError: shape bug in my model (raised at ")
    assert f"{__file__}:" in message and "in _users_forward" in message


def test_a_valueerror_of_autobatchs_own_checks_stays_bad_input():
    from autobatch.memory.units import parse_bytes

    with pytest.raises(ValueError) as info:
        parse_bytes("abc")
    message, code = describe(info.value)
    assert code == BAD_INPUT and "raised at" not in message


def test_the_probes_trial_note_reaches_the_line_with_the_command_lines_key():
    """The note that names multiple_of was dropped (``str(exc)`` leaves notes out)."""
    exc = with_trial_note(RuntimeError("batch must be even"), 1)
    message, code = describe(exc)
    assert code == RUNTIME_FAILURE
    assert "set probe.multiple_of=2 so that no batch below 2" in message
    assert "find_max_batch" not in message and "probe.memory_limit" in message


def test_a_model_target_that_builds_no_module_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"model\._target_='builtins\.dict' built a builtins\.dict, not a torch\.nn\.Module"):
        construct("model", {"_target_": "builtins.dict"}, expect=torch.nn.Module)
    assert isinstance(construct("model", {"_target_": "torch.nn.ReLU"}, expect=torch.nn.Module), torch.nn.ReLU)


def _hints(command: str, config_dir: str | None, name: str, jobs: list[list[str]]) -> list[str]:
    """The one line :func:`preflight.check` makes of each job's composition error, composed on one
    search path (a ``check`` per job costs a second of the CI box)."""
    from hydra import compose

    from autobatch.cli.user_config import composing

    lines = []
    with composing(command, config_dir):
        for job in jobs:
            with pytest.raises(Exception) as info:
                compose(name, overrides=job)
            message, _ = describe(info.value)
            lines.append(preflight._composition_hint(preflight._override_hint(message, info.value), info.value))
    return lines


def test_a_misspelt_key_of_a_typed_option_names_the_closest_key():
    """Hydra advised ``+model.layrs=2``, which the model's constructor then rejected."""
    model, optimizer, free = _hints("probe", None, "probe", [
        ["model.layrs=2"], ["optimizer=sgd", "optimizer.momentun=0.5"], ["model=target", "model.widht=3"]])  # fmt: skip
    assert model.startswith("Could not override 'model.layrs': model (GPTConfig) has no key 'layrs' (did you mean model.layers?)")
    assert "optimizer (SGDConfig) has no key 'momentun' (did you mean optimizer.momentum?)" in optimizer
    assert "To append to your config use +model.widht=3" in free  # untyped: + adds a constructor argument


def test_a_wrong_key_in_a_users_yaml_names_the_file_and_the_key(tmp_path):
    """Before: "In 'mine': ConfigKeyError raised while composing config: Key 'stpes' not in 'TrainConfig'"."""
    (tmp_path / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\ntrain:\n  stpes: 3\n")
    (tmp_path / "typed.yaml").write_text("defaults:\n  - train\n  - _self_\ntrain:\n  steps: abc\n")
    misspelt, typed = [_hints("train", str(tmp_path), name, [[]])[0] for name in ("mine", "typed")]
    assert misspelt == "mine.yaml sets train.stpes, but train has no key 'stpes' (did you mean train.steps?)"
    assert typed == "typed.yaml sets train.steps: Value 'abc' of type 'str' could not be converted to Integer"


def test_an_out_of_memory_give_up_before_any_step_does_not_say_steps_were_saved(tmp_path):
    """Before: "...; the steps before it are saved, step 0: no step of this run finished, nothing saved"."""
    exc = StepOutOfMemoryError(0, "backward", False)
    with pytest.raises(CLIError) as info:
        interrupt.stopped(exc, SimpleNamespace(step=0), SimpleNamespace(received=None), out_dir=tmp_path, logged=None,
                          metrics=None, resume=None)
    assert "saved, step" not in info.value.message and info.value.message.endswith("; no step of this run finished, nothing saved")


def _in_a_sweeps_job(tmp_path, monkeypatch):
    """Hydra's config of job 1 of a sweep into ``tmp_path``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    node = SimpleNamespace(mode=RunMode.MULTIRUN, sweep=SimpleNamespace(dir=str(tmp_path)), job=SimpleNamespace(num=1),
                           runtime=SimpleNamespace(cwd=str(tmp_path), output_dir=str(tmp_path / "1")),
                           overrides=SimpleNamespace(task=["model.width=12"]))
    (tmp_path / "1").mkdir()
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: node))


def _only_row(tmp_path):
    with open(tmp_path / "summary.csv", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert (row["job"], row["overrides"], row["status"]) == ("1", "model.width=12", "interrupted")
    return row


def test_a_sweeps_job_stopped_by_a_signal_is_a_row_of_the_summary(tmp_path, monkeypatch):
    """Hydra does not catch the SystemExit a stopped job ends with, so on_job_end never ran:
    the summary listed the jobs before it alone and said "0 failed"."""
    _in_a_sweeps_job(tmp_path, monkeypatch)
    with pytest.raises(SystemExit):
        interrupt.stopped(KeyboardInterrupt(), SimpleNamespace(step=0), SimpleNamespace(received=signal.SIGTERM, exit_code=143),
                          out_dir=tmp_path / "1", logged=None, metrics=None, resume=None)
    assert _only_row(tmp_path)["error"].startswith("interrupted (SIGTERM) at step 0; no step of this run finished")


def test_a_sweeps_job_interrupted_before_training_is_a_row_of_the_summary(tmp_path, monkeypatch):
    """A Ctrl-C during a probe: the KeyboardInterrupt passes on (the command says it), the row stays."""
    from autobatch.cli.errors import reported

    _in_a_sweeps_job(tmp_path, monkeypatch)
    with pytest.raises(KeyboardInterrupt), reported(multirun=True):
        raise KeyboardInterrupt
    assert _only_row(tmp_path)["error"].startswith("interrupted (SIGINT) before any step trained")
