"""Tensors a model keeps as plain attributes (not registered), and putting them back.

A forward may cache a tensor as a plain attribute of its module: ``self.mask = torch.ones(B, ...)``,
``self._cache = ...`` grown to the largest batch seen, a ``(cos, sin)`` tuple, a dict of masks by
size. No ``register_buffer`` is involved, so :func:`~autobatch.probe.snapshot.restore_places.put_back_layout`
never sees them: after the probe the model still held the last trial's tensor, and a mask a
failed trial made at a large size was held through the trials below it (a probe answered 2261
where a fresh process trains 2331), which :meth:`~autobatch.probe.snapshot.restore.Snapshot.undo_forward`
between trials prevents. :class:`TensorAttributes` records them before the trials and puts them back:

* an attribute the trials added that holds a tensor (or a list, tuple or dict holding one) is
  removed;
* an attribute that held a tensor gets it back: the same object while anything holds it (where
  forward left it, or elsewhere; its values written back where they were changed in place),
  else a fresh copy of the values it had, on its device, one copy for every place that shared
  it (only a weak reference is kept, so a mask forward replaced is freed during the trials).
  A tensor that is also a parameter or buffer of the model, or one the optimizer trains, a
  view, or a tensor subclass is put back as the object itself (its values are the snapshot's
  business, or its base's);
* an attribute that held something else (``None``, a ``(cos, sin)`` tuple) and now holds a
  tensor gets that object back, and a list or dict that held a tensor, or holds one now, gets
  its items back (the same objects: the items' values are not copied);
* on a module whose class is not torch's own (yours, a library's), a plain scalar attribute
  (``bool``, ``int``, ``float``, ``str``, ``None``) the trials changed gets its value back, and
  one they added is removed: a step counter (``self.step += 1``) or a temperature a schedule
  anneals in forward, and a data-dependent initialisation's ``self.initialized = True`` (Glow's
  ActNorm), which left as the trials set it would skip that initialisation in training. The
  fake-tensor estimate puts every attribute back (:mod:`.trace_state`). Torch's own modules
  (``DistributedDataParallel``'s flags) are left alone;
* each module's hooks (``_forward_hooks``, ``_forward_pre_hooks``, ... : ``nn.Module``'s hook
  dicts) that the trials registered are removed, with the flags (one the trials removed stays
  removed: a hook that removes itself at its first call, the CLI's input check): a library that registers hooks at a model's
  first forward and marks it so on the model (Transformers 5's output capturing,
  ``_output_capturing_hooks_installed``) had its mark removed with the trials' other added
  scalars and its hooks kept, so the next forward registered them again and every hidden state was
  captured twice (a SegFormer then fed its decoder's stage-2 projection the stage-1 features:
  "mat1 and mat2 shapes cannot be multiplied" at the first batch after the probe).

Only each module's ``__dict__`` is scanned, and a container one level deep (a list of lists is
not looked into; nor is one of more than 10,000 items): no walk of the objects the model
reaches. The copies are host memory, made once; what is put back is device memory where an
active simulated budget counted the original.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable

import torch

from ...memory.devices import simulated_counts
from ...memory.simulated import host_memory

__all__ = ["TensorAttributes"]

#: a blank ``nn.Module``'s attributes, which both sets below are read from
_BLANK = vars(torch.nn.Module())
#: ``nn.Module``'s own bookkeeping (parameters, buffers, submodules, hooks, ``training``)
_MODULE_KEYS = frozenset(_BLANK)
#: ``nn.Module``'s hook dicts, put back whole (:meth:`TensorAttributes.put_back`)
_HOOK_KEYS = frozenset(key for key, value in _BLANK.items() if "hooks" in key and isinstance(value, dict))
#: the largest container looked into (a module holding a dataset as a list is not scanned)
_MOST_ITEMS = 10_000
_ABSENT = object()
#: plain values a forward may keep on a module of its own (a counter, a flag), put back by value
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _own(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class is not torch's own: its plain scalar attributes are put back."""
    return not type(module).__module__.startswith("torch.")


def _items(value: Any) -> Iterable[Any]:
    return value.values() if isinstance(value, dict) else value


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor, or a list, tuple or dict holding one (one level deep)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple, dict)) and len(value) <= _MOST_ITEMS:
        return any(isinstance(item, torch.Tensor) for item in _items(value))
    return False


class _Copy:
    """A host copy of a plain tensor, and how to tell whether the original is still in place."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.original = weakref.ref(tensor)  # a strong reference would hold a replaced mask on the device
        self.version = None if tensor.is_inference() else tensor._version
        self.device, self.counted = tensor.device, simulated_counts(tensor)
        self.requires_grad = tensor.requires_grad and tensor.is_leaf
        self.data = tensor.detach().to("cpu", copy=True)

    def put_back(self, made: dict[int, torch.Tensor]) -> torch.Tensor:
        """The original while anything holds it (its values written back where they were changed
        in place), else one fresh copy of its values, shared by every place that held it."""
        original = self.original()
        if original is not None:  # still held (where forward left it, or elsewhere): the same object
            if self.version is not None and original._version != self.version:
                with torch.no_grad():
                    original.copy_(self.data)
                self.version = original._version
            return original
        key = id(self)
        if key not in made:
            with contextlib.nullcontext() if self.counted else host_memory():
                made[key] = self.data.to(self.device, copy=True).requires_grad_(self.requires_grad)
        return made[key]


class TensorAttributes:
    """The tensor-holding plain attributes of every module of ``model`` (see the module's
    docstring); :meth:`put_back` restores them, as often as needed. ``kept``: tensors put back
    as themselves (parameters the optimizer trains outside the model)."""

    def __init__(self, model: torch.nn.Module | None, kept: Iterable[torch.Tensor] = ()) -> None:
        #: per module, each plain attribute: a :class:`_Copy`, a container with its items, or the object
        self.saved: list[tuple[torch.nn.Module, dict[str, Any], bool]] = []
        #: per module, the handles' ids in each hook dict
        self.hooks: list[tuple[torch.nn.Module, dict[str, set]]] = []
        if model is None:
            return
        objects = {id(t) for t in (*model.parameters(), *model.buffers(), *kept)}
        copies: dict[int, _Copy] = {}
        for module in model.modules():
            saved: dict[str, Any] = {}
            for name, value in vars(module).items():
                if name in _MODULE_KEYS:
                    continue
                if isinstance(value, torch.Tensor) and _copied(value, objects):
                    saved[name] = copies.setdefault(id(value), _Copy(value))
                elif isinstance(value, (list, dict)) and len(value) <= _MOST_ITEMS:
                    saved[name] = _Items(value)
                else:
                    saved[name] = value
            self.saved.append((module, saved, _own(module)))
            self.hooks.append((module, {key: set(value) for key, value in vars(module).items()
                                        if key in _HOOK_KEYS and isinstance(value, dict)}))

    def put_back(self) -> None:
        """Remove what the trials added, put back what they replaced or changed (see above)."""
        made: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for module, saved, own in self.saved:
                attributes = vars(module)
                for name in [k for k in attributes if k not in saved and k not in _MODULE_KEYS]:
                    if holds_tensor(attributes[name]) or (own and isinstance(attributes[name], _SCALARS)):
                        del attributes[name]
                for name, was in saved.items():
                    current = attributes.get(name, _ABSENT)
                    if isinstance(was, _Copy):
                        attributes[name] = was.put_back(made)
                    elif isinstance(was, _Items):
                        if was.involved(current):
                            attributes[name] = was.put_back()
                    elif current is not was and (holds_tensor(current) or holds_tensor(was) or (
                            own and isinstance(was, _SCALARS) and (current is _ABSENT or isinstance(current, _SCALARS)))):
                        attributes[name] = was  # None again where a tensor was cached; a tuple, a view; a counter
        for module, hooks in self.hooks:  # with the flags that say they are there (module docstring)
            for key, items in hooks.items():
                current = vars(module).get(key)
                for added in [k for k in current if k not in items] if isinstance(current, dict) else ():
                    del current[added]  # one removed stays removed: a hook that removes itself at its first call


class _Items:
    """A list or dict attribute and a shallow copy of its items (the same objects)."""

    def __init__(self, container: list | dict) -> None:
        self.container, self.items = container, (list(container) if isinstance(container, list) else dict(container))

    def involved(self, current: Any) -> bool:
        """Whether tensors are at stake: the container held one, holds one, or was replaced by one."""
        return holds_tensor(self.items) or holds_tensor(self.container) or (
            current is not self.container and holds_tensor(current))

    def put_back(self) -> list | dict:
        """The container with its items as they were (left alone where they are the same)."""
        container, items = self.container, self.items
        same = len(container) == len(items) and (
            all(a is b for a, b in zip(container, items)) if isinstance(container, list)
            else all(key in container and container[key] is value for key, value in items.items()))
        if not same:
            container.clear()
            (container.extend if isinstance(container, list) else container.update)(items)
        return container


def _copied(tensor: torch.Tensor, objects: set[int]) -> bool:
    """Whether ``tensor``'s values are copied: a plain tensor, not a view (its base is put back,
    or holds it), not a parameter, buffer or kept tensor of the model, with values to copy."""
    return (type(tensor) is torch.Tensor and id(tensor) not in objects and tensor._base is None
            and not tensor.is_meta and tensor.layout == torch.strided)
