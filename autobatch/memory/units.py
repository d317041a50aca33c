"""Byte quantities: parse "512MiB"-style strings and format byte counts for people; and
:func:`counted`, a count with its noun in the right number ("1 rank", "2 ranks")."""

from __future__ import annotations

import numbers
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["parse_bytes", "format_bytes", "decimal_note", "counted"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    # Kubernetes' binary suffixes ("8Gi", "512Mi"): powers of 1024 like KiB, MiB, GiB, TiB
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
#: the units the messages list
_NAMED = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "memory_limit") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts a positive whole number of bytes (an int of any integer type, such as a NumPy ``int64``
    computed from a config, or a whole float such as ``1e9``), or a string such as ``"512MiB"``, ``"2GiB"``,
    ``"1.5GB"`` or ``"1000000"``, in any case and with or without a space. Binary units (KiB,
    MiB, GiB, TiB, and Kubernetes' Ki, Mi, Gi, Ti) are powers of 1024, decimal units (KB, MB,
    GB, TB, and the single letters K, M, G, T: ``"16m"`` is 16,000,000 bytes, 15.26 MiB) powers
    of 1000; a fraction with a unit, or a large count such as ``0.9 * total``, is rounded down to whole
    bytes (``"0.3KiB"`` is 307), and a small count in bytes that is not whole (``1.5``, ``"1.5B"``: a
    missing unit) is an error, where it was a 1-byte budget.
    ``name`` is the argument named in the error message; a list or tuple
    (``[8, "GiB"]``, ``["8GiB"]``) is one error giving the string to write instead.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(_not_a_quantity(value, name))
    if isinstance(value, numbers.Integral):  # a NumPy int64 too, as every integer argument takes
        number, unit = int(value), ""  # exact: a float would round a large count
    elif isinstance(value, numbers.Real):  # a NumPy float32 too
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        stripped = value.strip()
        if stripped.startswith("-") and _PATTERN.match(stripped.lstrip("-")) is not None:
            raise ValueError(f"{name} must be positive, got {value!r}; give a number of bytes or a string such as "
                             "'512MiB' or '2GiB'")  # not "not a byte quantity"
        if stripped.endswith("%"):  # a share of the device: the capacity it is a share of is not known here
            raise ValueError(f"{name}={value!r}: a percentage is not taken, only a byte quantity; {_share(name)}")
        if stripped.lower() in ("none", "null", "off", "unlimited"):  # "no limit", read from a config or CLI as text
            raise ValueError(f"{name}={value!r} is a string, not 'no limit': for no limit pass None (null in a "
                             "YAML config or on the command line), else a byte quantity such as '16GiB'")
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a byte quantity; use a number of bytes or a string "
                f"such as '512MiB', '2GiB', '1.5GB' (units: {_NAMED})"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    scaled = number * _UNITS[unit]
    if not scaled <= sys.float_info.max:
        # int() would raise OverflowError (inf, "1e400") or a ValueError that names no argument
        # (nan); a count past any float breaks the arithmetic that sizes batches from it
        raise ValueError(f"{name}={value!r} is not a finite byte count; give a number of bytes such as '80GiB'")
    if 1 <= scaled < 1024 and _UNITS[unit] == 1 and not float(number).is_integer():  # int() kept 1 of 1.5 bytes
        raise ValueError(_not_whole(value, number, name))
    result = int(scaled)
    if result <= 0:
        if 0 < scaled < 1 and unit == "":  # 0.5: half a GiB, or half the device
            raise ValueError(f"{name}={value!r} is less than one byte: did you mean '{str(value).strip()}GiB'? A "
                             f"share of the device is not taken: {_share(name)}")
        raise ValueError(f"{name} must be positive, got {value!r}; give a number of bytes or a string such as "
                         "'512MiB' or '2GiB'")
    return result


def _share(name: str) -> str:
    """The advice for a share of the device (``"80%"``, ``0.8``), whose capacity is not read here: in
    Python the bytes computed, in a config or on the command line (``name`` is dotted there) a size."""
    return (f"compute the bytes, in Python e.g. {name.rsplit('.', 1)[-1]}=int(0.8 * "
            f"torch.cuda.get_device_properties(0).total_memory), or give a size, {name}='64GiB'")


def _not_whole(value: int | float | str, number: float, name: str) -> str:
    """The message for a small count of bytes that is not whole (``1.5``, ``"1.5"``, ``"1.5B"``): a
    fraction of a byte is no size, and ``int()`` silently made ``1.5`` a 1-byte budget; most likely a
    missing unit. A large one (a computed share such as ``0.9 * total``) is rounded down: a fraction
    of a byte there changes nothing."""
    return (f"{name}={value!r} is {number!r} bytes, not a whole number of bytes (did you mean '{number:g}GiB'?); "
            "give bytes as an int or a string with a unit, such as '512MiB' or '1.5GiB'")


def _not_a_quantity(value: Any, name: str) -> str:
    """The message for a ``value`` that is neither a number nor a string: for a list or tuple
    (``[8, "GiB"]``, a Hydra ``[8,GiB]``), the one string to write instead where its items make one."""
    advice = "give one byte count, a number of bytes or a string such as '512MiB' or '2GiB'"
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        items = list(value)
        single = len(items) == 1 and isinstance(items[0], str)  # ["8GiB"]
        pair = len(items) == 2 and isinstance(items[0], (int, float)) and isinstance(items[1], str)  # [8, "GiB"]
        joined = "".join(str(item) for item in items) if single or pair else ""
        try:
            parse_bytes(joined, name=name)
        except ValueError:
            joined = ""
        kind = type(value).__name__
        if joined:
            return f"{name}={value!r} is a {kind}, not a byte quantity; write {name}={joined!r}"
        return f"{name}={value!r} is a {kind}, not a byte quantity; {advice}"
    if isinstance(value, (bytes, bytearray)):
        return f"{name}={value!r} is bytes, not a string; write {name}={value.decode(errors='replace')!r}"
    return f"{name} must be a byte count or a string like '512MiB' or '2GiB', got {value!r:.80} ({type(value).__name__})"


def decimal_note(count: int) -> str:
    """`` (16,000,000 bytes: "16M" and "16MB" are powers of 1000; "16MiB" is 16 x 1024**2)`` for a
    byte count that is a whole number of decimal megabytes (or more) but not of MiB, else ``""``:
    a message that shows such a limit in binary units (15.26 MiB) says where the odd number came
    from (``memory_limit="16m"`` read as decimal, as the docs say)."""
    for unit, size in (("T", 1000**4), ("G", 1000**3), ("M", 1000**2)):
        if count >= size and count % size == 0 and count % 1024**2 != 0:
            number = count // size
            return (f" ({count:,} bytes: '{number}{unit}' and '{number}{unit}B' are powers of 1000; "
                    f"'{number}{unit}iB' is {number} x 1024**{'MGT'.index(unit) + 2})")
    return ""


def format_bytes(count: int | float | None) -> str:
    """Format a byte count with a binary unit, e.g. ``1.50 GiB``; ``None`` gives ``"-"``."""
    if count is None:
        return "-"
    if isinstance(count, str):  # float("8GiB") failed with "could not convert string to float"
        raise TypeError(f"format_bytes takes a byte count (a number) or None, got the string {count!r:.40}; "
                        "to read a string such as '8GiB' as bytes, use parse_bytes")
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        digits = 0 if unit == "B" else 2
        if abs(round(value, digits)) < 1024:  # rounded first: 2**20 - 1 is "1.00 MiB", not "1024.00 KiB"
            return f"{value:.{digits}f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun`` in the number it takes, for messages: ``counted(1, "rank")`` is
    "1 rank", ``counted(2, "rank")`` "2 ranks" (``plural`` where it is not ``noun + "s"``:
    ``counted(n, "OOM recovery", "OOM recoveries")``). Messages said "sharded over 1 ranks"."""
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"
