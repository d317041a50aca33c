"""The probe options :class:`~autobatch.integrations.lightning.AutoBatchSize` takes, checked
where the callback is built (:func:`checked_probe_options`). Split from :mod:`.lightning` to keep
each module readable; it needs no framework."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from ..probe.arguments import validate_probe_args
from ..probe.find import find_max_batch

__all__ = ["checked_batch_arg_name", "checked_probe_options"]

_SEARCHED = {"hparams", "datamodule", "trainer"}  # a path through these names a field lightning_hasattr finds


def checked_batch_arg_name(name: Any) -> None:
    """Refuse a ``batch_arg_name`` that Lightning's ``lightning_hasattr`` cannot find, when the
    callback is built. Why: a non-string failed at fit start inside Lightning ("attribute name
    must be string"), and a path such as ``"hparams.batch_size"`` (as a user writes who reads
    ``self.hparams.batch_size``) was refused with a ``TypeError`` that did not say what to write
    instead: the field alone is looked up in the module, its ``hparams``, the datamodule and its
    ``hparams``, and set in each that has it, as ``BatchSizeFinder`` does. A path into another object
    (a nested config, ``"cfg.batch_size"``, or ``"hparams.data.batch_size"``) was told the same, and
    the field alone then failed at fit start with "no field 'batch_size'": it names the property with a
    setter that reaches it instead."""
    if not isinstance(name, str) or not name.isidentifier():
        field = name.rsplit(".", 1)[-1] if isinstance(name, str) else ""
        holder = name.rsplit(".", 1)[0] if isinstance(name, str) else ""
        if isinstance(name, str) and "." in name and field.isidentifier() and not set(holder.split(".")) <= _SEARCHED:
            raise ValueError(  # a nested config (cfg.batch_size): the field alone would not be found there either
                f"AutoBatchSize: batch_arg_name={name!r} names a field of {holder!r}, which is not looked up: the "
                "field is found only in the module, its hparams, the datamodule and the datamodule's hparams (as "
                f"Lightning's BatchSizeFinder). Give the module or datamodule a property {field!r} with a setter that "
                f"reads and writes {holder}.{field}, build the train dataloader from it, and pass "
                f"batch_arg_name={field!r}; or keep the size in one of those places")
        if isinstance(name, str) and "." in name and field.isidentifier():
            raise ValueError(
                f"AutoBatchSize: batch_arg_name={name!r} is a path; name the field alone, batch_arg_name={field!r}: "
                "it is looked up in the module, its hparams, the datamodule and the datamodule's hparams, and the "
                "size is set in each that has it (as Lightning's BatchSizeFinder does)")
        raise TypeError(f"batch_arg_name must name the batch size attribute (a string such as 'batch_size'), "
                        f"got {name!r}")


def checked_probe_options(given: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options for :func:`~autobatch.find_max_batch`, checked at construction (one error naming
    the option), where a bad one failed only at fit start, as a bare ``ZeroDivisionError`` for
    ``multiple_of=0``, and ``max_batch=0`` meant no cap."""
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"probe_options must be a mapping of find_max_batch's options, got {type(extra).__name__}")
    accepted = set(inspect.signature(find_max_batch).parameters) - {"fn", "device"} - set(given)
    for name in extra or {}:
        if name in given:
            raise TypeError(f"AutoBatchSize: pass {name} as AutoBatchSize's own argument, not in probe_options")
        if name not in accepted:
            why = "the callback sets it" if name in ("fn", "device") else "find_max_batch does not take it"
            raise TypeError(f"AutoBatchSize: probe_options cannot have {name!r} ({why}); it accepts "
                            f"{', '.join(sorted(accepted))}")
    options = {**given, **(extra or {})}
    checked = validate_probe_args(start=options.get("start"), max_batch=options["max_batch"],
                                  strategy=options["strategy"], margin=options["margin"],
                                  multiple_of=options["multiple_of"], steps_per_trial=options["steps_per_trial"],
                                  search_steps=options.get("search_steps"))
    # plain ints (a NumPy multiple_of would make the batch size written to the module a NumPy one)
    return {**options, **{name: value for name, value in checked.items() if name in options}}
