"""Callbacks into the runner that do not keep it alive.

The runner hands its own methods to objects it holds: tenacity's ``Retrying`` (``retry=``,
``stop=``) and the step guard (``room=``). A bound method holds its object, so each was a reference
cycle (runner → ``Retrying`` → ``runner._is_retryable`` → runner), and a runner, its model and its
optimizer outlived ``del runner``: freed by the garbage collector's next full collection, not at
once as torch's own objects are. In a notebook that builds a second runner to train again, the
first one's weights, gradients and optimizer state stayed on the device, and the second one's
probe measured that much less (a micro-batch of 16 where 24 trains, review 38). :func:`weakly`
calls the method through a weak reference instead.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

__all__ = ["weakly"]


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method), called through a weak reference to its object: the function
    returned does not keep that object alive, and raises ``ReferenceError`` once it is gone. Its
    signature is the bound method's (what tenacity and the step guard call it with)."""
    ref = weakref.WeakMethod(method)
    name = method.__func__.__qualname__

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError(f"{name}: the object it was a method of is gone")
        return bound(*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = method.__name__, name, method.__doc__
    call.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    return call
