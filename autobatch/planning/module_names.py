"""Module names across wrappers: a plan's checkpointed modules as another copy of the model has them.

A plan made on a DDP- or ``torch.compile``-wrapped model names ``module.blocks.0`` or
``_orig_mod.blocks.0``; the bare model it is applied to has ``blocks.0``, and the other way round.
Checkpoint targets that match no class are checked here against the model's module names too
(a module's name given for its class, a dotted class path). Kept apart from
:mod:`autobatch.planning.checkpointing` (which re-exports these names), which wraps the blocks.
"""

from __future__ import annotations

from torch import nn

__all__ = ["WRAPPER_ATTRIBUTES", "has_module", "misnamed_targets", "module_names_for", "short_names"]


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


def misnamed_targets(model: nn.Module, names: list[str]) -> str:
    """Why targets that match no class may have missed: a module's *name* given for a class
    (``'blocks.0'``: its class is named instead, or ``Plan.apply`` / ``enable_checkpointing(modules=)``
    take names), or a dotted class path (``'torch.nn.TransformerEncoderLayer'``, a Hydra
    ``_target_``: the bare class name matches)."""
    classes = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
    for name in names:
        if name and has_module(model, name):
            kind = type(model.get_submodule(name)).__name__
            return (f"; {name!r} is the name of a module of the model, not a class: targets are class names "
                    f"(its class: {kind!r}), and enable_checkpointing(model, modules=[...]) takes module names")
        tail = name.rsplit(".", 1)[-1]
        if "." in name and tail in classes:
            return f"; targets are bare class names, not dotted paths: {tail!r} for {name!r}"
    return ""
