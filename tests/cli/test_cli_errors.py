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
