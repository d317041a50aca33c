"""Bad input: one line naming what to fix, a non-zero exit status, never a traceback."""

from __future__ import annotations

import pytest

from autobatch.__main__ import main

from conftest import SMALL, cli_env

BAD_INPUT = [
    (["prob"], "unknown command 'prob'; did you mean 'probe'?"),
    (["fit"], "choose one of: probe, train"),
    (["probe", "probe.stratgy=binary"], "Could not override 'probe.stratgy'"),
    (["probe", "probe.start=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
    (["probe", "probe.strategy=fast"], "Invalid value 'fast', expected one of [auto, predict, binary, power, halving, estimate]"),
    (["probe", "model=transformer"], "Could not find 'model/transformer'"),
    (["probe", "probe.start=64", "probe.max_batch=8"], "probe.start=64 is larger than probe.max_batch=8"),
    (["probe", "probe.multiple_of=0"], "multiple_of must be a positive integer"),
    (["probe", "model._target_=nowhere.Net"], "model._target_='nowhere.Net' cannot be imported"),
    (["train", "optimizer._target_=torch.optim.Adamm"], "torch.optim has no attribute 'Adamm'"),
    (["train", "train.steps=0"], "train.steps must be >= 1"),
    (["train", "train.max_grad_norm=0"], "train.max_grad_norm must be a positive number or null, got 0"),
    (["train", "train.inject_oom=[[1,sideways]]"], "train.inject_oom entries must be [step, phase]"),
    (["train", "train.step_guard=gpu"], "Invalid value 'gpu', expected one of [auto, cpu, device, off]"),
    (["train", "train.empty_cache_threshold=lots"], "train.empty_cache_threshold='lots' is not a byte quantity"),
    (["probe", "train.global_batch=0"], "train.global_batch must be a positive integer or null"),
    (["probe", "plan.objective=fastest"], "Invalid value 'fastest', expected one of [max_batch, throughput]"),
    (["probe", "plan.retime_within=1.5"], "plan.retime_within must be a fraction in [0, 1)"),
    (["probe", "plan.timed_steps=0"], "plan.timed_steps must be an integer >= 1, got 0"),
    (["probe", "plan.min_micro_batch=0"], "plan.min_micro_batch must be a positive integer or null, got 0"),
    (["probe", "probe.search_steps=0"], "probe.search_steps must be a positive integer or null, got 0"),
    (["cache", "purge"], "cache: argument action: invalid choice: 'purge'"),
    (["probe", "model=mlp,gpt"], "Ambiguous value for argument 'model=mlp,gpt'"),
    (["probe", "-m", "model=mlp,gpt", "probe.margin=0.1,2"], "probe.margin must be a fraction in [0, 1)"),
    (["probe", "--bogus"], "unknown option '--bogus'"),
    # keys added with + to a typed group: rejected with the closest key (free only under a _target_)
    (["probe", "+probe.stratgy=binary"], "+probe.stratgy: probe has no key 'stratgy' (did you mean probe.strategy?)"),
    (["train", "+train.stpes=2"], "did you mean train.steps?"),
    (["probe", "+seeed=1"], "the top level has no key 'seeed' (did you mean seed?)"),
    (["probe", "+data.shap=[3]"], "did you mean data.shape?"),
    (["probe", "probe.stratgy=binary"], "probe has no key 'stratgy' (did you mean probe.strategy?)"),
    (["probe", "model=mlp", "+model.widht=3"], "model.widht is not an argument of autobatch.workloads.models.MLP (did you mean width?)"),
    # an optimizer by _target_ over adamw's keys: named, with the option that has none
    (["probe", "optimizer._target_=torch.optim.Adagrad"], "optimizer.betas is not an argument of torch.optim.Adagrad"),
    # sizes and counts must be positive; the data must suit the model
    (["probe", "data.seq_len=0"], "data.seq_len must be a positive integer, got 0"),
    (["probe", "model.layers=-1"], "model.layers must be a positive integer, got -1"),
    (["probe", "data.vocab_size=0"], "data.vocab_size must be a positive integer, got 0"),
    (["probe", "model=mlp", "data.shape=[0,3]"], "data.shape must be positive integers, got [0, 3]"),
    (["probe", "model=mlp", "data.shape=[]"], "data.shape must be a non-empty list of positive integers, got []"),
    (["probe", "data.min_seq_len=300", "data.seq_len=256"], "data.min_seq_len=300 is larger than data.seq_len=256"),
    (["probe", "model=cnn", "data.shape=[64]"], "data.shape=[64] does not suit model._target_=autobatch.workloads.models.ResNetCNN"),
    (["probe", "model.inputs=tensor"], "model.inputs=tensor: GPT takes tokens"),
    (["probe", "model=target", "model._target_=null"], "model._target_ is not set; give an import path such as model._target_=torchvision"),
    # a launcher that is a plugin: how to install it
    (["probe", "-m", "hydra/launcher=submitit_slurm"], 'pip install hydra-submitit-launcher (from the checkout: pip install -e ".[slurm]")'),
    # a flag that prints the config still reports a misspelt key in one line
    (["probe", "--cfg", "job", "probe.stratgy=x"], "Could not override 'probe.stratgy'"),
]


@pytest.mark.parametrize("args, words", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(args, words, capsys, monkeypatch):
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("autobatch: error: ") and err.count("\n") == 1, err
    assert words in err


def test_no_command_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().out


# Through the real process: Hydra's own error paths, exit statuses, no traceback.
@pytest.mark.parametrize(
    "args, code, words",
    [
        (["probe", "probe.stratgy=binary"], 2, "Could not override 'probe.stratgy'"),
        (["probe", "model._target_=torch.nn.Linearr"], 2, "torch.nn has no attribute 'Linearr'"),
        (["probe", "model.heads=3", *SMALL], 2, "GPT width=32 must be divisible by heads=3"),
        (["probe", "probe.memory_limit=64KiB", *SMALL], 1, "No batch size fits: batch 1 ran out of memory"),
    ],
)
def test_errors_in_a_real_process(cli, args, code, words):
    done = cli(*args)
    assert done.returncode == code, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("autobatch: error: ") and words in lines[0], done.stderr


def test_autobatch_traceback_shows_the_traceback(cli):
    done = cli("probe", "model.heads=3", *SMALL, env=cli_env(AUTOBATCH_TRACEBACK="1"))
    assert done.returncode == 2
    assert "Traceback (most recent call last)" in done.stderr and "divisible by heads" in done.stderr


def test_hydra_verbose_raises_instead_of_one_line(monkeypatch):
    from autobatch.cli.errors import CLIError

    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    with pytest.raises(CLIError, match="probe.start must be a positive integer or null"):
        main(["probe", "hydra.verbose=true", "probe.start=0"])
    assert main(["probe", "hydra.verbose=false", "probe.start=0"]) == 2


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path, capsys, monkeypatch):
    """Hydra makes the run directory before any task runs and reports a failure with a traceback."""
    monkeypatch.delenv("AUTOBATCH_TRACEBACK", raising=False)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for where, words in [(afile, "is a file, not a directory"), (afile / "run", "is a file, not a directory"),
                         ("/proc/nope", "cannot create it in /proc")]:
        assert main(["probe", "model=mlp", f"hydra.run.dir={where}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"autobatch: error: hydra.run.dir={where}: ") and err.count("\n") == 1 and words in err, err
    assert main(["probe", "-m", "model=mlp", f"hydra.sweep.dir={afile}"]) == 2
    assert "hydra.sweep.dir=" in capsys.readouterr().err and afile.read_text() == "mine"


def test_print_flags_still_print_a_config_that_composes(capsys):
    assert main(["probe", "--cfg", "job", "model=mlp", "probe.start=64", "probe.max_batch=8"]) == 0
    assert "max_batch: 8" in capsys.readouterr().out  # shown as given, not validated


@pytest.mark.parametrize(
    "args, words",
    [
        (["plan.checkpoint_modules=[_DecoderBlok]", "train.global_batch=64"],
         "plan.checkpoint_modules: no module of class '_DecoderBlok' in the model (did you mean _DecoderBlock?); "
         "its module classes: GPT, "),
        (["data=dataset"], "takes token ids but data.dataset's inputs are float32 tensors of shape [16]"),
        (["model=cnn", "data=dataset"], "takes 3 dimensions [channels, height, width] but data.dataset's inputs"),
        (["model=mlp", "data=dataset", "train.global_batch=1024"], "train.global_batch=1024 is larger than data.dataset (512 samples)"),
        # half-precision inputs for float32 weights without autocast (a RuntimeError in the first matmul)
        (["model=mlp", "data.dtype=bfloat16"], "data.dtype=bfloat16 does not match the model's float32 weights with "
         "precision=fp32 (no autocast); set precision=bf16"),
        # a value the constructor rejects: the group, its target and the override to fix
        (["optimizer.betas=[0.9]"], "optimizer: torch.optim.AdamW rejected its arguments (IndexError: list index out "
         "of range); check optimizer.betas=[0.9]"),
        (["model.dropout=1.5"], "model: autobatch.workloads.models.GPT rejected its arguments (ValueError: dropout "
         "probability has to be between 0 and 1, but got 1.5); check model.width=32 model.dropout=1.5"),
    ],
)
def test_errors_found_once_the_model_and_data_exist(cli_here, args, words):
    done = cli_here("probe", *SMALL, *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("autobatch: error: ") and done.stderr.count("\n") == 1 and words in done.stderr, done.stderr


def test_library_errors_name_the_command_lines_keys():
    from autobatch.cli.errors import describe
    from autobatch.errors import GlobalBatchTooLargeError, StepOutOfMemoryError

    message, code = describe(GlobalBatchTooLargeError(64, 16, False, "cpu"))
    assert code == 1 and message.startswith("train.global_batch=64 does not fit in one step")
    assert "(plan.allow_accumulation=true)" in message and "allow_accumulation=True" not in message
    assert "activation checkpointing (plan.allow_checkpointing=true)" in message
    assert "train.checkpointing_fallback=true" in describe(StepOutOfMemoryError(3, "forward", False))[0]


def test_a_rejected_learning_rate_names_train_lr(cli_here):
    done = cli_here("train", "model=mlp", *SMALL[:3], "train.micro_batch=4", "train.steps=1", "train.lr=-1")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("autobatch: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "optimizer: torch.optim.AdamW rejected its arguments (ValueError: Invalid learning rate: -1.0); check train.lr=-1" in done.stderr


class Broken:
    """A constructor with an error of its own (not a rejected argument)."""

    def __init__(self, fail: bool = True) -> None:
        if fail:
            raise RuntimeError("broken inside")
        raise ValueError("fail must be true")


def test_a_constructor_error_that_is_not_about_its_arguments_is_raised_as_it_is():
    from autobatch.cli.build import construct

    with pytest.raises(RuntimeError, match="broken inside"):  # an error in the user's code: as it is (exit 1)
        construct("model", {"_target_": f"{__name__}.Broken"})
    with pytest.raises(ValueError, match=r"^model: \S+Broken rejected its arguments \(ValueError: fail must be true\); check "):
        construct("model", {"_target_": f"{__name__}.Broken", "fail": False})



def test_review34_optimizers_train_cannot_step_are_one_line_naming_what_to_give():
    """``optimizer._target_=torch.optim.LBFGS`` under train got the probe's advice for Python code
    (find_max_batch(fn, ...)), also with train.micro_batch (no probe); SparseAdam on dense parameters
    failed at the first step with torch's RuntimeError. (build.validate and build_workload call these.)"""
    import torch
    from omegaconf import OmegaConf

    from autobatch.cli.optimizer_fit import check_optimizer_gradients, check_optimizer_target

    instead = "optimizer=adamw, optimizer=sgd, or optimizer=target optimizer._target_=torch.optim.Adam"
    node = OmegaConf.create({"_target_": "torch.optim.LBFGS", "lr": 0.1})
    with pytest.raises(ValueError) as raised:
        check_optimizer_target(node, torch.optim.LBFGS)
    assert str(raised.value).startswith("optimizer._target_=torch.optim.LBFGS needs a closure in step(closure)")
    assert str(raised.value).endswith(instead) and "find_max_batch" not in str(raised.value)
    check_optimizer_target(node, torch.optim.AdamW)  # a first-order one: nothing to say
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    node = OmegaConf.create({"_target_": "torch.optim.SparseAdam"})
    check_optimizer_gradients(node, torch.optim.SparseAdam(model[0].parameters()), model)  # sparse rows only: fine
    with pytest.raises(ValueError, match=r"^optimizer._target_=torch.optim.SparseAdam steps sparse gradients only, and 2 "
                                         r"of the model's parameters get dense ones \(1.weight, 1.bias;") as raised:
        check_optimizer_gradients(node, torch.optim.SparseAdam(model.parameters()), model)
    assert str(raised.value).endswith(instead)
