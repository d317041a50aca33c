"""Checks of a composed config that its types cannot make, each a ``ValueError`` naming the key.

:func:`~autobatch.cli.build.validate` runs the checks that need only the config (before
anything is built); :func:`~autobatch.cli.build.build_workload` runs the others once the
model and the dataset exist:

* :func:`check_unknown_keys`: a key added with ``+`` to a typed group (``+probe.stratgy=``)
  would otherwise be carried along and never read. Only a node with a ``_target_`` (a model,
  an optimizer, a dataset) takes free keys: they are its constructor's arguments, which
  :func:`check_target_arguments` checks against the constructor's signature instead.
* :func:`check_sizes`: every integer of the built-in model and data schemas is a size or a
  count; zero or a negative one builds a model that runs nothing (a probe of ``data.seq_len=0``
  answers the search's ceiling) or fails deep inside torch.
* :func:`check_input_shape` / :func:`check_dataset_inputs`: a built-in model takes one kind
  of input (token ids, or float tensors of a given rank); other data fails inside its forward.
* :func:`check_checkpoint_modules`: a misspelt block class would wrap nothing and the plan
  would then fail for a reason that is not the real one.
* :func:`check_dataset_size`: a batch larger than a finite dataset repeats its samples.
* :func:`check_data_dtype`: half-precision synthetic inputs meet float32 weights only under
  autocast, and a built-in model's ``data.dataset`` inputs (numpy's float64) only when they have
  its dtype or autocast casts them; else the first forward fails inside torch.
* :func:`check_missing`: a required key left unset (``???``: a group option of the user's own
  that extends a schema and omits one) failed inside Hydra's instantiate as "Missing mandatory
  value: in_shape", without the group it belongs to.
* :func:`check_micro_bounds`: ``train.min_micro_batch`` / ``train.micro_batch`` /
  ``train.max_micro_batch`` out of order failed in the runner, after the probe or the plan.
* :func:`check_cache_dir`: a ``probe.cache_dir`` that is a file (or under one) cached nothing,
  with two warnings that blamed the entries, where ``cache list --dir`` of it is an error.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import typing
from pathlib import Path
from typing import Any, Iterable

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from .config import CNNConfig, DataConfig, GPTConfig, MLPConfig, ModelConfig, OptimizerConfig
from .key_source import NotAnArgument
from .schema_keys import check_unknown_keys, close_match, closest, schema_of

log = logging.getLogger("autobatch")

__all__ = [
    "close_match",
    "check_unknown_keys",
    "check_sizes",
    "check_input_shape",
    "check_target_arguments",
    "target_parameters",
    "check_dataset_inputs",
    "check_checkpoint_modules",
    "check_dataset_size",
    "check_data_dtype",
    "check_cache_dir",
    "schema_of",
]


def _int_kind(hint: Any) -> str | None:
    """``"int"`` for an ``int`` or ``Optional[int]`` field, ``"list"`` for ``List[int]``."""
    if hint is int:
        return "int"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and set(args) == {int, type(None)}:
        return "int"
    if origin is list and args == (int,):
        return "list"
    return None


def check_sizes(cfg: DictConfig) -> None:
    """Every integer of the typed ``data`` and ``model`` nodes (sizes and counts: ``seq_len``,
    ``vocab_size``, ``layers``, ``width``, each entry of ``shape``...) must be positive."""
    for group in ("data", "model"):
        node = cfg.get(group)
        schema = schema_of(node)
        if schema is None:
            continue
        hints = typing.get_type_hints(schema)
        for field in dataclasses.fields(schema):
            kind = _int_kind(hints.get(field.name))
            if kind is None or OmegaConf.is_missing(node, field.name):
                continue
            value = node[field.name]
            values = list(value) if kind == "list" and value is not None else [value]
            if kind == "list" and value is not None and not values:
                raise ValueError(f"{group}.{field.name} must be a non-empty list of positive integers, got []")
            if any(v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1) for v in values):
                shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
                what = "positive integers" if kind == "list" else "a positive integer"
                null = " or null" if field.default is None else ""
                raise ValueError(f"{group}.{field.name} must be {what}{null}, got {shown}")
    data = cfg.data
    if data.get("min_seq_len") is not None and data.min_seq_len > data.seq_len:
        raise ValueError(f"data.min_seq_len={data.min_seq_len} is larger than data.seq_len={data.seq_len}; lower it")


def _input_kind(cfg: DictConfig) -> tuple[str, tuple[str, ...] | None] | None:
    """What a built-in model takes: (``tensor`` or ``tokens``, the names of its per-sample
    dimensions when it needs a fixed number); None for a ``_target_`` model (unknown), also one
    typed by a structured config of the user's own (which need not have an ``inputs`` key)."""
    schema = schema_of(cfg.model)
    if schema is None or not issubclass(schema, (MLPConfig, CNNConfig, GPTConfig)):  # what it takes is its own business
        return None
    kind = getattr(cfg.model.inputs, "name", str(cfg.model.inputs))
    default = {f.name: f.default for f in dataclasses.fields(schema)}["inputs"]
    if kind != default.name:
        raise ValueError(f"model.inputs={kind}: {schema.__name__.removesuffix('Config')} takes {default.name}; drop model.inputs")
    return kind, getattr(schema, "INPUT_DIMS", None)


def _dims_text(dims: tuple[str, ...]) -> str:
    return f"{len(dims)} dimensions [{', '.join(dims)}]"


def check_input_shape(cfg: DictConfig) -> None:
    """Synthetic tensor data of a built-in model that needs a fixed rank (the CNN: ``[channels,
    height, width]``) must have that many ``data.shape`` entries."""
    found = _input_kind(cfg)
    if found is None or cfg.data.dataset is not None:
        return
    kind, dims = found
    shape = list(cfg.data.shape)
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    # a shape set for a token model, where nothing token-shaped was: say so, go on (a config for
    # models of both kinds, as a sweep's, sets data.seq_len too, and is not told)
    if kind == "tokens" and shape != list(fields["shape"].default_factory()) and cfg.data.seq_len == fields["seq_len"].default:
        log.warning("data.shape=%s is not used: model._target_=%s reads token ids (data.seq_len=%s tokens from a "
                    "vocabulary of data.vocab_size=%s); drop data.shape or set those", shape, cfg.model._target_,
                    cfg.data.seq_len, cfg.data.vocab_size)
    if kind == "tensor" and dims is not None and len(shape) != len(dims):
        raise ValueError(
            f"data.shape={shape} does not suit model._target_={cfg.model._target_}, which takes "
            f"{_dims_text(dims)}; give data.shape {len(dims)} entries"
        )


def _describe_sample(sample: Any) -> str:
    """What a dataset's sample is, for a message: its type, and its items or shape."""
    if isinstance(sample, (tuple, list)):
        return f"a {type(sample).__name__} of {len(sample)} items ({', '.join(type(item).__name__ for item in sample)})"
    if isinstance(sample, dict):
        return f"a dict with keys {', '.join(map(str, list(sample)[:6]))}"
    if isinstance(sample, torch.Tensor):
        return f"a tensor of shape {list(sample.shape)}"
    return f"a {type(sample).__name__}"


def check_dataset_inputs(cfg: DictConfig, dataset: Any) -> Any:
    """A ``_target_`` dataset's samples must be ``(input, target)`` pairs (the CLI's loss takes
    them apart; anything else failed deep in training as "too many values to unpack"), judged
    by its first sample; and their inputs must suit a built-in model: token ids (integers) for
    ``tokens``, floating tensors of the model's rank for ``tensor``. Returns that first input
    (None for an empty dataset), for :func:`check_data_dtype`: the sample is read once."""
    found = _input_kind(cfg)
    sample = dataset[0] if len(dataset) else None
    if sample is not None and not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise ValueError(
            f"data.dataset={cfg.data.dataset.get('_target_')}: its samples must be (input, target) pairs, but "
            f"data.dataset[0] is {_describe_sample(sample)}; give a dataset whose __getitem__ returns (input, target)"
        )
    inputs = sample[0] if sample is not None else None
    if found is None or not isinstance(inputs, torch.Tensor):
        return inputs  # a _target_ model takes what its dataset gives; anything else is for collate to judge
    kind, dims = found
    what = f"{str(inputs.dtype).replace('torch.', '')} tensors of shape {list(inputs.shape)}"
    target = cfg.model._target_
    if kind == "tokens" and inputs.is_floating_point():
        raise ValueError(f"model._target_={target} takes token ids but data.dataset's inputs are {what}; "
                         "use a tensor model (model=mlp, model=cnn) or a dataset of token ids")
    if kind == "tensor" and not inputs.is_floating_point():
        raise ValueError(f"model._target_={target} takes float tensors but data.dataset's inputs are {what}; "
                         "use a token model (model=gpt) or a dataset of float inputs")
    if kind == "tensor" and dims is not None and inputs.dim() != len(dims):
        raise ValueError(f"model._target_={target} takes {_dims_text(dims)} but data.dataset's inputs are {what}")
    _check_sized_for(cfg, inputs, what)
    return inputs


def _check_sized_for(cfg: DictConfig, inputs: torch.Tensor, what: str) -> None:
    """The built-in model is sized by ``data.shape`` (``model.in_shape``, ``model.in_channels`` read it),
    which a dataset leaves at its default: inputs of another size failed in the first forward as
    torch's "mat1 and mat2 shapes cannot be multiplied". Say the ``data.shape`` to give instead."""
    schema = schema_of(cfg.model)
    key, want, got = (("in_shape", math.prod(cfg.model.in_shape), inputs.numel()) if schema and issubclass(schema, MLPConfig)
                      else ("in_channels", cfg.model.in_channels, inputs.shape[0]) if schema and issubclass(schema, CNNConfig)
                      else (None, None, None))
    if key is None or want == got:
        return
    node = cfg.model._get_node(key)
    fix = (f"data.shape={list(inputs.shape)}".replace(" ", "") if node is not None and node._is_interpolation()
           else f"model.{key}=" + (str(list(inputs.shape)).replace(" ", "") if key == "in_shape" else str(got)))
    given = cfg.model[key]
    raise ValueError(f"model.{key}={list(given) if isinstance(given, ListConfig) else given} does not suit data.dataset's inputs, "
                     f"{what}; give {fix}")


def target_parameters(target: Any) -> tuple[list[str], bool] | None:
    """(the named arguments ``target`` takes, whether it also takes ``**kwargs``); None when its
    signature cannot be read (some C extensions)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    names = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names, any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())


def check_target_arguments(key: str, node: DictConfig, target: Any, *, own: Iterable[str] = ()) -> None:
    """Every key of the ``_target_`` node ``key`` (but ``_target_`` and the CLI's ``own`` keys)
    must be an argument of ``target``, unless it takes ``**kwargs``. Catches a misspelt
    ``+model.widht=`` and keys left by a group option after ``key._target_`` changed
    (``optimizer._target_=torch.optim.Adagrad`` keeps adamw's ``betas``)."""
    found = target_parameters(target)
    if found is None or found[1]:
        return
    names = found[0]
    skip = {"_target_", "_convert_", "_recursive_", "_partial_", "_args_", *own}
    schema = schema_of(node)
    typed = {field.name for field in dataclasses.fields(schema)} if schema is not None else set()
    unknown = [str(name) for name in node.keys() if name not in skip and name not in names]
    if len(unknown) > 1 and not typed.intersection(unknown):  # all in one line, not one rerun per key
        listed = ", ".join(f"{key}.{name}" for name in unknown)
        fresh = _FRESH_OPTION.get(key, "")
        raise NotAnArgument(  # the YAML of the user's that sets them is named by preflight (autobatch.cli.key_source)
            f"{listed} are not arguments of {node._target_}; its arguments: "
            f"{', '.join(n for n in names if n not in ('self', 'params')) or 'none'}", "Remove them with "
            + " ".join(f"~{key}.{name}" for name in unknown) + (f" or start from {fresh}" if fresh else ""),
            [f"{key}.{name}" for name in unknown])
    for name in unknown:
        hint = close_match(str(name), names)  # "start from model=target" only where the option is not it already
        fresh = _FRESH_OPTION.get(key, "") if schema not in (None, ModelConfig, OptimizerConfig) else ""
        if name in typed:  # a key of the option's schema (model=mlp, optimizer=adamw): ~ cannot remove it
            fix = (f"{key}.{name} comes from the {key} option's schema ({schema.__name__}), which keeps its keys "
                   f"(~{key}.{name} is refused); start from {fresh or 'a group option without it'}")
        else:  # a misspelt argument (+model.hiden=64): the one meant, in its place
            meant, raw = closest(str(name), names), node._get_node(name)._value()
            value = str(raw).lower() if isinstance(raw, bool) else raw if isinstance(raw, (int, float, str)) else "VALUE"
            fix = (f"Give +{key}.{meant}={value} in its place (~{key}.{name} removes it where a config of yours sets it)"
                   if meant and meant not in node
                   else f"Remove it with ~{key}.{name}" + (f" or start from {fresh}" if fresh else ""))
        raise NotAnArgument(f"{key}.{name} is not an argument of {node._target_}{hint}; its arguments: "
                            f"{', '.join(n for n in names if n not in ('self', 'params')) or 'none'}", fix, [f"{key}.{name}"])


#: The group option that holds only a ``_target_`` (and what the CLI wires in), whose keys are
#: the constructor's arguments, each removable with ``~``.
_FRESH_OPTION = {
    "optimizer": "optimizer=target (only _target_ and lr)",
    "model": "model=target (only _target_ and inputs; +model.<argument>=VALUE for each argument)",
}


def check_checkpoint_modules(cfg: DictConfig, model: torch.nn.Module) -> None:
    """Each class name in ``plan.checkpoint_modules`` must be the class (or a base class) of a
    module of ``model``, as activation checkpointing matches them."""
    wanted = list(cfg.plan.checkpoint_modules) if "plan" in cfg else []
    if not wanted:
        return
    present: dict[str, None] = {}
    matched: set[str] = set()
    for module in model.modules():
        present.setdefault(type(module).__name__)
        matched.update(cls.__name__ for cls in type(module).__mro__)
    missing = [name for name in wanted if name not in matched]
    if missing:
        raise ValueError(
            f"plan.checkpoint_modules: no module of class {missing[0]!r} in the model{close_match(missing[0], present)}; "
            f"its module classes: {', '.join(present)}"
        )


def check_dataset_size(cfg: DictConfig, size: int, world: int = 1) -> None:
    """Batches larger than a finite dataset of ``size`` samples would repeat samples: the
    global batch (``train.global_batch``, else ``train.micro_batch`` times the ranks) and the
    probe's first size must fit in it. (The probe's largest size is capped at it.)"""
    train = cfg.train
    checks = [("train.global_batch", train.global_batch, 1)]
    if train.global_batch is None:
        checks.append(("train.micro_batch", train.micro_batch, world))
    checks += [("probe.start", cfg.probe.start, world), ("probe.multiple_of", cfg.probe.multiple_of, world)]
    for key, value, per in checks:
        if value is not None and value * per > size:
            ranks = f" over {world} ranks" if per > 1 else ""
            raise ValueError(f"{key}={value}{ranks} is larger than data.dataset ({size} samples); a batch cannot hold "
                             f"more samples than the dataset has, lower {key}")


def check_data_dtype(cfg: DictConfig, model: torch.nn.Module, autocast_dtype: torch.dtype | None,
                     first_input: Any = None) -> None:
    """Synthetic tensor inputs of ``data.dtype`` (bfloat16, float16) must match the model's
    floating weights unless autocast (``precision=bf16`` or ``fp16``) casts them: float32
    weights and bfloat16 inputs fail in the first matmul ("mat1 and mat2 must have the same
    dtype"). Token ids (``model.inputs=tokens``) are not judged; a ``data.dataset`` is judged by
    :func:`_check_dataset_dtype` on its ``first_input`` (what :func:`check_dataset_inputs` read)."""
    data = cfg.data
    if data.dataset is not None:
        _check_dataset_dtype(cfg, model, autocast_dtype, first_input)
        return
    if autocast_dtype is not None:
        return
    if getattr(cfg.model.get("inputs", "tensor"), "name", str(cfg.model.get("inputs", "tensor"))) != "tensor":
        return
    name = getattr(data.dtype, "name", str(data.dtype))
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if weights is None or str(weights) == f"torch.{name}":
        return
    autocast = {"bfloat16": "bf16", "float16": "fp16"}.get(name)
    fix = f"set precision={autocast} (autocast casts the inputs and the weights' matmuls) or " if autocast else ""
    raise ValueError(
        f"data.dtype={name} does not match the model's {str(weights).replace('torch.', '')} weights with "
        f"precision={getattr(cfg.precision, 'name', cfg.precision)} (no autocast); {fix}"
        f"set data.dtype={str(weights).replace('torch.', '')}"
    )


def check_missing(cfg: DictConfig) -> None:
    """``ValueError`` naming each key without a value (``???``), but a ``_target_`` (the check of
    the target says what to give there)."""
    missing = sorted(key for key in OmegaConf.missing_keys(cfg) if not key.endswith("_target_"))
    if missing:
        listed = ", ".join(missing)
        raise ValueError(f"{listed} {'has' if len(missing) == 1 else 'have'} no value (??? in the config); set "
                         f"{'it' if len(missing) == 1 else 'each'} in your config or on the command line: "
                         + " ".join(f"{key}=VALUE" for key in missing))


def check_micro_bounds(train: DictConfig) -> None:
    """``train.min_micro_batch <= train.micro_batch <= train.max_micro_batch`` (the ones set):
    the runner refused them with its own argument names only once the probe or plan had run."""
    named = [(key, train[key]) for key in ("min_micro_batch", "micro_batch", "max_micro_batch") if train[key] is not None]
    for (low, low_value), (high, high_value) in zip(named, named[1:]):
        if low_value > high_value:
            raise ValueError(f"train.{low}={low_value} is above train.{high}={high_value}; lower train.{low} or raise "
                             f"train.{high}")


def check_cache_dir(cfg: DictConfig, base: Path | None = None) -> None:
    """``probe.cache_dir`` (with ``probe.cache``) must be a directory or one that can be made:
    ``ValueError`` where it, or a directory above it, is a file. ``base``: where a relative one
    is (the directory the command ran in)."""
    probe = cfg.probe
    if not probe.cache or probe.cache_dir is None:
        return
    if not str(probe.cache_dir).strip():  # Path("") is the directory the command ran in
        raise ValueError("probe.cache_dir= is empty; give the cache directory, or leave it out (null) for the default, "
                         "or probe.cache=false")
    path = Path(str(probe.cache_dir)).expanduser()
    path = path if path.is_absolute() or base is None else base / path
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        shown = existing.relative_to(base) if base is not None and existing.is_relative_to(base) else existing
        where = "is a file" if existing == path else f"is under a file, {shown}"
        raise ValueError(f"probe.cache_dir={probe.cache_dir} {where}, not a directory; give a directory for the probe "
                         "cache (it is made if missing), or probe.cache=false")


def _check_dataset_dtype(cfg: DictConfig, model: torch.nn.Module, autocast_dtype: torch.dtype | None, inputs: Any) -> None:
    """A built-in tensor model's ``data.dataset`` inputs (its first sample's: a tensor or an
    array, such as numpy's float64 default) must have its weights' dtype, or one autocast casts
    (it never casts float64): else the probe's first trial failed inside torch ("mat1 and mat2
    must have the same dtype"), exit status 1, naming neither the key nor the fix."""
    found = _input_kind(cfg)
    if found is None or found[0] != "tensor" or inputs is None:
        return  # a _target_ model may cast its inputs itself
    if not isinstance(inputs, torch.Tensor):
        if not (hasattr(inputs, "dtype") and hasattr(inputs, "__array__")):
            return
        try:
            inputs = torch.as_tensor(inputs)
        except (TypeError, ValueError, RuntimeError):
            return
    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if weights is None or not inputs.is_floating_point() or inputs.dtype == weights:
        return
    if autocast_dtype is not None and inputs.dtype != torch.float64:
        return  # autocast casts them
    name, wanted = (str(d).replace("torch.", "") for d in (inputs.dtype, weights))
    why = "autocast never casts float64" if name == "float64" else "no autocast; precision=bf16 or fp16 would cast them"
    raise ValueError(
        f"data.dataset={cfg.data.dataset.get('_target_')}: its inputs are {name} but the model's weights are {wanted} "
        f"(precision={getattr(cfg.precision, 'name', cfg.precision)}: {why}); return {wanted} inputs from the "
        f"dataset's __getitem__ (e.g. torch.as_tensor(x, dtype=torch.{wanted}))"
    )
