"""Module names across wrappers: a plan's checkpointed modules as another copy of the model has them.

A plan made on a DDP- or ``torch.compile``-wrapped model names ``module.blocks.0`` or
``_orig_mod.blocks.0``; the bare model it is applied to has ``blocks.0``, and the other way round.
Checkpoint targets are read here (:func:`checkpoint_targets`), and those that match no class are checked
against the model's module names and classes (a module's name given for its class, a dotted class path,
a pattern, another case). Kept apart from
:mod:`autobatch.planning.checkpointing` (which re-exports these names), which wraps the blocks.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import Counter
from typing import Any, Sequence

from torch import nn

__all__ = ["WRAPPER_ATTRIBUTES", "checkpoint_targets", "has_module", "misnamed_targets", "module_names_for", "short_names",
           "unregistered_hint"]


#: attributes under which a wrapper holds the model: DDP's and DataParallel's ``module``,
#: ``torch.compile``'s ``_orig_mod``, FSDP1's and checkpoint_wrapper's own
WRAPPER_ATTRIBUTES = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def has_module(model: nn.Module, name: str) -> bool:
    """Whether ``model`` has a module of the qualified ``name``."""
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def short_names(names: list[str], limit: int = 4) -> str:
    """The first ``limit`` names, quoted, in brackets, with a count where there are more."""
    shown = ", ".join(repr(name) for name in names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


def module_names_for(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` (module names of the model a plan was made on) as ``model`` has them, where the
    two differ by wrappers (:data:`WRAPPER_ATTRIBUTES`): a plan made on a DDP- or
    ``torch.compile``-wrapped model names ``module.blocks.0``, the bare model has ``blocks.0``,
    and the other way round. Unchanged where they all resolve already, or where no such
    translation makes them all resolve (:func:`~autobatch.planning.checkpointing.enable_checkpointing` then names the missing)."""
    stripped = [list(names)]  # planned wrapped: its wrappers' leading names taken off, one at a time
    while all("." in name for name in stripped[-1]) and len(heads := {n.split(".", 1)[0] for n in stripped[-1]}) == 1 \
            and heads <= set(WRAPPER_ATTRIBUTES):
        stripped.append([name.split(".", 1)[1] for name in stripped[-1]])
    prefixes, inner = [""], model  # applied wrapped: the wrappers' names put in front
    while (child := next((name for name, _ in inner.named_children() if name in WRAPPER_ATTRIBUTES), None)) is not None:
        inner = inner.get_submodule(child)
        prefixes.append(f"{prefixes[-1]}{child}.")
    for found in stripped:
        for prefix in prefixes:
            if all(has_module(model, prefix + name) for name in found):
                return [prefix + name for name in found]
    return list(names)


#: the attributes every nn.Module has (its registries among them): never a user's plain container of modules
_MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))


def unregistered_hint(model: nn.Module) -> str:
    """Where repeated modules with parameters sit in plain Python attributes of the model's modules (``self.blocks =
    [Block() for _ in range(4)]``, a tuple or dict of them, one level of nesting), which PyTorch does not register,
    a sentence saying so and what to change; else empty (a single module kept in a list, an EMA teacher hidden from
    ``state_dict`` on purpose, is no block). Neither the automatic rule nor ``checkpoint_targets`` can
    reach such blocks (nor ``model.parameters()``, ``state_dict`` or ``.to()``), and the error said "activation
    checkpointing cannot help this model" or listed the model's classes without theirs."""
    registered = {id(module) for module in model.modules()}
    found = []
    for prefix, owner in model.named_modules():
        for attr, value in vars(owner).items():
            if attr in _MODULE_ATTRIBUTES or not isinstance(value, (list, tuple, dict)):
                continue
            entries = [inner for entry in (value.values() if isinstance(value, dict) else value) for inner in (
                (entry.values() if isinstance(entry, dict) else entry) if isinstance(entry, (list, tuple, dict)) else [entry])]
            hidden = [entry for entry in entries if isinstance(entry, nn.Module) and id(entry) not in registered
                      and any(True for _ in entry.parameters())]
            repeated = [cls for cls, count in Counter(type(entry) for entry in hidden).items() if count >= 2]
            if repeated:  # blocks; one module kept out on purpose (an EMA teacher in a list, off state_dict) is none
                found.append(f"{prefix + '.' if prefix else ''}{attr}: a {type(value).__name__} of {len(hidden)} "
                             f"modules, {', '.join(cls.__name__ for cls in repeated)}")
    if not found:
        return ""
    return (f"the model holds modules with parameters in plain Python attributes ({'; '.join(found[:4])}), which PyTorch "
            "does not register: autobatch cannot checkpoint them, and model.parameters(), state_dict() and .to() leave "
            "them out (an optimizer built from model.parameters() does not train them); hold them in nn.ModuleList or "
            "nn.ModuleDict (self.blocks = nn.ModuleList([...]))")


def unregistered_notes(model: nn.Module) -> list[str]:
    """The plan's note (a list of one, else empty) for blocks in plain Python attributes (:func:`unregistered_hint`),
    whatever the plan: one that fits without checkpointing said nothing of them, though the optimizer built from
    ``model.parameters()`` does not train them and ``model.double()`` / ``.to(device)`` leave them behind. Logged as a
    warning too. A plan that tries checkpointing says it again, as why nothing was wrapped (that fuller note replaces it)."""
    hint = unregistered_hint(model)
    if not hint:
        return []
    logging.getLogger("autobatch").warning("plan: %s", hint)
    return [hint]


def misnamed_targets(model: nn.Module, targets: Sequence[Any]) -> str:
    """Why targets that match no class may have missed: a module's *name* given for a class
    (``'blocks.0'``: its class is named instead, or ``Plan.apply`` / ``enable_checkpointing(modules=)``
    take names), a dotted class path (``'torch.nn.TransformerEncoderLayer'``, a Hydra
    ``_target_``: the bare class name matches), a glob pattern (``'layers.*'``, ``'*Block'``: names are
    matched exactly, and the error listed the classes as if one were misspelt), a class name in other
    case (``'gpt2block'``), or modules of another copy of the model (a deepcopy's blocks)."""
    classes = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
    if unregistered := unregistered_hint(model):
        return f"; {unregistered}"
    if any(isinstance(target, nn.Module) for target in targets):
        return ("; modules given as targets match only those very objects, which this model does not hold (another "
                "copy's blocks?): pass its own modules, or their class")
    names = [target for target in targets if isinstance(target, str)]
    for name in names:
        named = [module_name for module_name, _ in model.named_modules() if fnmatch.fnmatchcase(module_name, name)]
        outermost = [found for found in named if not any(found.startswith(f"{other}.") for other in named)]
        pattern = [found for found in sorted(classes) if fnmatch.fnmatchcase(found, name)] or sorted(
            {type(model.get_submodule(found)).__name__ for found in outermost})
        if any(char in name for char in "*?[") and pattern:
            return (f"; targets are class names matched exactly, not patterns: what {name!r} matches is of the classes "
                    f"{', '.join(repr(found) for found in pattern[:4])}: pass those")
        same = [found for found in sorted(classes) if found.lower() == name.lower()]
        if same:
            return f"; class names are matched in their case: {same[0]!r} for {name!r}"
    for name in names:
        if name and has_module(model, name):
            kind = type(model.get_submodule(name)).__name__
            return (f"; {name!r} is the name of a module of the model, not a class: targets are class names "
                    f"(its class: {kind!r}), and enable_checkpointing(model, modules=[...]) takes module names")
        tail = name.rsplit(".", 1)[-1]
        if "." in name and tail in classes:
            return f"; targets are bare class names, not dotted paths: {tail!r} for {name!r}"
    return ""


def checkpoint_targets(targets: Any) -> tuple[str | type | nn.Module, ...] | None:
    """``targets`` as a tuple of class names, classes and modules of the model (a bare one is one target;
    a container, ``model.layers``, stands for its entries: a ``ModuleDict`` iterated its keys, names taken
    for classes); one ``TypeError`` for anything else (an int raised an AttributeError from the error
    message; ``checkpoint_targets=model.layers`` was one naming the ModuleList's repr, cut mid-line), one
    ``ValueError`` for none at all."""
    if targets is None:
        return None
    wanted = (targets,) if isinstance(targets, (str, type, nn.Module)) else targets
    try:
        wanted = tuple(wanted)
    except TypeError:
        wanted = (targets,)
    # a container, bare or in the list ([model.layers]), stands for its entries: wrapped itself it was never called
    wanted = tuple(entry for target in wanted for entry in (
        [m for m in target._modules.values() if m is not None]
        if isinstance(target, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) else [target]))
    if not wanted:  # it matched nothing, and the error listed the model's classes as if one were misspelt
        raise ValueError("checkpoint targets are empty: name the block classes to wrap (e.g. ['GPTBlock']), or "
                         "pass None for autobatch's choice (repeated blocks of a Sequential or ModuleList); "
                         "allow_checkpointing=False turns checkpointing off")
    wrong = [target for target in wanted if not isinstance(target, (str, type, nn.Module))]
    if wrong:
        raise TypeError("checkpoint targets must be class names (e.g. 'GPTBlock') or classes (or modules of the model), "
                        f"one or a list of them; got {type(targets).__name__}, which holds {type(wrong[0]).__name__} "
                        f"{wrong[0]!r:.40}")
    classes = [target for target in wanted if isinstance(target, type) and not issubclass(target, nn.Module)]
    if classes:  # ``[int]`` was "match no module of the model", as if a block class were misspelt
        raise TypeError(f"checkpoint targets must be nn.Module classes or their names; {classes[0].__name__} is no "
                        "nn.Module subclass: name the model's block class (e.g. 'GPTBlock')")
    return wanted
