"""The file a plot is written to (:func:`plot_file`), checked before anything is drawn.

:func:`~autobatch.report.plots.plot_probe` and :func:`~autobatch.report.plots.plot_sweep` return
exactly the file they wrote: ``~`` is expanded, a path without a suffix gets ``.png`` (as
matplotlib would add), an existing directory gets the default file name inside it. A suffix
matplotlib cannot write (``curve.xyz``, or a name with a dot meant as part of it, ``run.v2``) is
one ``ValueError`` naming the path and the file to give, before the figure is drawn: before, the
figure was drawn and matplotlib's ``savefig`` raised its bare ``Format 'v2' is not supported``
from inside, naming neither the path nor what to change.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["plot_file"]


def plot_file(path: str | os.PathLike, default_name: str) -> Path:
    """The file a plot given ``path`` is written to: ``~`` expanded; inside an existing
    directory, ``default_name``; without a suffix, ``.png`` appended. Returning this path, not
    the one given, means the caller can open what it gets back. A suffix matplotlib cannot
    write is a ``ValueError``."""
    if not isinstance(path, (str, os.PathLike)):  # else pathlib's "expected str, bytes or os.PathLike object"
        raise TypeError(f"path must be the PNG file (or directory) to write, a str or Path, got {type(path).__name__} "
                        f"{path!r:.40}; e.g. path='runs/memory_curve.png'")
    target = Path(path).expanduser()
    if target.is_dir():
        return target / default_name
    if not target.suffix:
        return target.with_name(target.name + ".png")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # the plot function's own check says what to install
        return target
    formats = FigureCanvasBase.get_supported_filetypes()
    if target.suffix[1:].lower() not in formats:
        raise ValueError(f"cannot write a plot to {str(path)!r}: matplotlib writes no {target.suffix!r} file; end the path "
                         f"in .png (e.g. {str(target.with_name(target.name + '.png'))!r}) or one of "
                         f"{', '.join('.' + name for name in sorted(formats))}")
    return target
