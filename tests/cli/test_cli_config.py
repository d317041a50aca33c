"""Config composition: the shipped YAMLs over the structured schemas (Hydra's compose API)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import autobatch.cli  # noqa: F401 - registers the schemas, makes autobatch.conf importable
from autobatch.cli.build import build_workload, memory_limit, select_device, validate
from autobatch.cli.config import GPTConfig, MLPConfig, Precision, Strategy

from conftest import REPO


@pytest.fixture
def conf():
    with initialize_config_module("autobatch.conf", version_base="1.3"):
        yield lambda name="probe", *overrides: compose(name, overrides=list(overrides))


def test_the_default_probe_config(conf):
    cfg = conf()
    assert OmegaConf.get_type(cfg.model) is GPTConfig
    assert cfg.probe.strategy is Strategy.auto and cfg.precision is Precision.fp32
    assert cfg.model.vocab_size == cfg.data.vocab_size and cfg.model.max_seq_len == cfg.data.seq_len
    assert cfg.device.type.name == "auto" and cfg.device.simulated_budget == "64MiB"
    assert cfg.train.global_batch is None  # the probe reads train.global_batch (the plan)
    assert cfg.plan.objective.name == "max_batch" and cfg.probe.cache is True
    validate(cfg)


def test_train_config_ties_the_optimizer_lr_to_train_lr(conf):
    cfg = conf("train", "train.lr=0.05", "optimizer=sgd")
    assert cfg.optimizer.lr == 0.05 and cfg.optimizer._target_ == "torch.optim.SGD"


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=mlp"],
        ["model=cnn", "data=imagenet"],
        ["model=gpt", "data=variable_length"],
        ["model=mlp", "data=dataset"],
        ["model=target", "model._target_=torch.nn.Flatten"],
        ["optimizer=sgd", "probe=safe", "device=cpu", "precision=bf16"],
        ["train.global_batch=512", "plan.objective=throughput", "plan.checkpoint_modules=[_DecoderBlock]"],
        ["plan.objective=throughput", "plan.timed_steps=3", "plan.retime_rounds=0", "plan.retime_within=0.05"],
    ],
)
def test_every_group_option_composes_and_validates(conf, overrides):
    validate(conf("probe", *overrides))


def test_model_interpolates_data(conf):
    cfg = conf("probe", "model=mlp", "data.shape=[8,8]", "data.num_classes=3")
    assert OmegaConf.get_type(cfg.model) is MLPConfig
    assert list(cfg.model.in_shape) == [8, 8] and cfg.model.num_classes == 3
    assert conf("probe", "model=cnn", "data.shape=[1,28,28]").model.in_channels == 1


@pytest.mark.parametrize(
    "override, words",
    [
        ("probe.stratgy=binary", "stratgy"),  # unknown key
        ("probe.start=abc", "probe.start=abc"),  # wrong type
        ("probe.strategy=fastest", "fastest"),  # not a choice
        ("precision=fp8", "fp8"),
        ("model=transformer", "model/transformer"),  # no such option
    ],
)
def test_schema_rejects_bad_overrides(conf, override, words):
    with pytest.raises(ConfigCompositionException, match=words):
        conf("probe", override)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["probe.start=64", "probe.max_batch=8"], "probe.start=64 is larger than probe.max_batch=8"),
        (["probe.margin=1.5"], "probe.margin must be"),
        (["probe.multiple_of=8", "probe.max_batch=4"], "probe.max_batch=4 is smaller than probe.multiple_of=8"),
        (["probe.memory_limit=lots"], "probe.memory_limit='lots' is not a byte quantity"),
        (["model._target_=nowhere.Net"], "model._target_='nowhere.Net' cannot be imported"),
        (["optimizer._target_=torch.optim.Adamm"], "torch.optim has no attribute 'Adamm'"),
    ],
)
def test_validate_names_the_key_to_fix(conf, overrides, words):
    with pytest.raises(ValueError, match=words):
        validate(conf("probe", *overrides))


def test_device_and_memory_limit(conf):
    cfg = conf("probe", "device=cpu")
    assert select_device(cfg) == torch.device("cpu")
    assert memory_limit(cfg, torch.device("cpu")) is None  # the library default budget
    assert memory_limit(conf("probe"), torch.device("cpu")) == "64MiB"
    assert memory_limit(conf("probe", "probe.memory_limit=1GiB"), torch.device("cpu")) == "1GiB"
    assert memory_limit(conf("probe"), torch.device("cuda", 0)) is None  # the whole GPU


@pytest.mark.parametrize("model", ["mlp", "cnn", "gpt"])
def test_built_workloads_train_one_step(conf, model):
    cfg = conf("probe", f"model={model}", "data.shape=[3,8,8]", "data.seq_len=8", "model.width=16")
    workload = build_workload(cfg)
    before = [p.detach().clone() for p in workload.model.parameters()]
    workload.probe_step(2)
    assert any(not torch.equal(a, b) for a, b in zip(before, workload.model.parameters()))


def test_variable_length_data_probes_the_worst_case(conf):
    cfg = conf("probe", "data=variable_length", "data.seq_len=32", "data.min_seq_len=4", "model.width=16")
    workload = build_workload(cfg)
    assert {workload.probe_step.make_batch(1)[0].shape[1] for _ in range(5)} == {32}
    lengths = {workload.make_batch(1)[0].shape[1] for _ in range(30)}
    assert len(lengths) > 1 and all(4 <= n <= 32 for n in lengths)


def test_a_target_dataset_feeds_the_batches(conf):
    cfg = conf("probe", "model=mlp", "data=dataset", "data.dataset.size=5", "data.shape=[4]")
    x, y = build_workload(cfg).make_batch(7)  # wraps around the 5 samples
    assert x.shape == (7, 4) and y.shape == (7,)


def test_every_yaml_starts_with_a_command_that_uses_it():
    files = sorted((REPO / "conf").rglob("*.yaml"))
    assert len(files) >= 15
    for path in files:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# python -m autobatch "), path


@pytest.mark.parametrize("precision, dtype", [("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_precision_sets_autocast(conf, precision, dtype):
    cfg = conf("probe", f"precision={precision}", "model=mlp", "data.shape=[4]", "model.width=8")
    workload = build_workload(cfg)
    assert workload.probe_step.autocast_dtype is dtype
    assert (workload.grad_scaler is not None) is (precision == "fp16")  # fp16 trains with a GradScaler
    workload.probe_step(2)


def test_any_model_by_target_with_its_arguments(conf):
    cfg = conf(
        "probe", "model=target", "model._target_=autobatch.workloads.models.MLP", "+model.in_shape=[4]",
        "+model.num_classes=3", "data.shape=[4]", "data.num_classes=3",
    )  # fmt: skip
    workload = build_workload(cfg)
    assert type(workload.model).__name__ == "MLP"
    workload.probe_step(2)


def test_resnet50_from_torchvision(conf):
    pytest.importorskip("torchvision")
    cfg = conf("probe", "model=resnet50", "data.shape=[3,32,32]")
    assert build_workload(cfg).model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


@pytest.mark.parametrize("app", ["probe", "train"])
def test_device_cudnn_benchmark_sets_autotuning_for_the_run(conf, app, monkeypatch):
    """Probe and train both honour ``device.cudnn_benchmark`` (default off, torch's default)."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    build_workload(conf(app, "model=mlp", "device=cpu"))
    assert torch.backends.cudnn.benchmark is False
    build_workload(conf(app, "model=mlp", "device=cpu", "device.cudnn_benchmark=true"))
    assert torch.backends.cudnn.benchmark is True


def test_device_expandable_segments_turns_the_allocator_setting_on_for_cuda(conf, monkeypatch):
    """The command line probes in one process and trains in another: on CUDA it makes the
    caching allocator's segments expandable unless the environment or the config says."""
    from autobatch.cli.build import configure_allocator
    from autobatch.memory import allocator

    made = []
    monkeypatch.setattr("autobatch.cli.build.set_expandable_segments", made.append)
    for var in allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    cuda = torch.device("cuda", 0)  # never touched: only its type is read
    assert configure_allocator(conf("train"), torch.device("cpu")) is None and made == []
    assert configure_allocator(conf("train"), cuda) is True and made == [True]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the user's own setting stands
    assert configure_allocator(conf("probe"), cuda) is None and made == [True]
    assert configure_allocator(conf("probe", "device.expandable_segments=true"), cuda) is True
    assert configure_allocator(conf("train", "device=cuda", "device.expandable_segments=false"), cuda) is False
    assert made == [True, True, False]


def test_schemas_are_not_options_of_the_groups(cli_here):
    """The structured configs are stored outside the groups: --help and "Available options" list
    only the YAML options."""
    done = cli_here("probe", "--help")
    assert done.returncode == 0, done.stderr
    assert "_schema" not in done.stdout and "optimizer: adamw, sgd, target" in done.stdout
    done = cli_here("probe", "model=transformer")
    assert "Available options in 'model': cnn gpt mlp resnet50 target" in done.stderr, done.stderr


def test_optimizer_target_sets_only_the_target_and_lr(conf):
    cfg = conf("train", "optimizer=target", "optimizer._target_=torch.optim.Adagrad", "+optimizer.lr_decay=0.01", "train.lr=0.05")
    assert dict(cfg.optimizer) == {"_target_": "torch.optim.Adagrad", "lr": 0.05, "lr_decay": 0.01}
    workload = build_workload(conf("probe", "model=mlp", "data.shape=[4]", "optimizer=target",
                                   "optimizer._target_=torch.optim.Adagrad"))
    assert type(workload.optimizer) is torch.optim.Adagrad


def test_a_shape_a_token_model_does_not_read_is_named(conf, caplog):
    """``model=gpt data.shape=[3,64,64]`` probed as if the shape were used: now a warning names
    it and what the model reads (a warning, not an error); the default shape, or a shape given
    beside a sequence length (a config for models of both kinds), says nothing."""
    from autobatch.cli.validation import check_input_shape

    with caplog.at_level("WARNING", logger="autobatch"):
        check_input_shape(conf("probe", "model=gpt"))
        assert "data.shape" not in caplog.text
        check_input_shape(conf("probe", "model=gpt", "data.shape=[3,64,64]", "data.seq_len=64"))
        assert "data.shape" not in caplog.text  # set for models of both kinds: nothing to say
        check_input_shape(conf("probe", "model=gpt", "data.shape=[3,64,64]"))
    assert "data.shape=[3, 64, 64] is not used" in caplog.text and "data.seq_len=128" in caplog.text
