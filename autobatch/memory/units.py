"""Byte quantities: parse "512MiB"-style strings and format byte counts for people."""

from __future__ import annotations

import numbers
import re
import sys

__all__ = ["parse_bytes", "format_bytes"]

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
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "memory_limit") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts a positive number of bytes (an int of any integer type, such as a NumPy ``int64``
    computed from a config, or a float), or a string such as ``"512MiB"``, ``"2GiB"``,
    ``"1.5GB"`` or ``"1000000"``. Binary units (KiB, MiB, GiB, TiB) are powers of 1024,
    decimal units (KB, MB, GB, TB) powers of 1000. ``name`` is the argument named in the
    error message.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a string like '512MiB' or '2GiB', got {value!r}")
    if isinstance(value, numbers.Integral):  # a NumPy int64 too, as every integer argument takes
        number, unit = int(value), ""  # exact: a float would round a large count
    elif isinstance(value, numbers.Real):  # a NumPy float32 too
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        stripped = value.strip()
        if stripped.startswith("-") and _PATTERN.match(stripped.lstrip("-")) is not None:
            raise ValueError(f"{name} must be positive, got {value!r}")  # not "not a byte quantity"
        if stripped.endswith("%"):  # a share of the device: the capacity it is a share of is not known here
            raise ValueError(
                f"{name}={value!r}: a percentage is not taken, only a byte quantity; compute the share yourself, e.g. "
                f"{name}=int(0.8 * torch.cuda.get_device_properties(0).total_memory), or give '64GiB'"
            )
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a byte quantity; use a number of bytes or a string "
                "such as '512MiB', '2GiB', '1.5GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f"{name} must be a byte count or a string like '512MiB' or '2GiB', got {value!r}")
    scaled = number * _UNITS[unit]
    if not scaled <= sys.float_info.max:
        # int() would raise OverflowError (inf, "1e400") or a ValueError that names no argument
        # (nan); a count past any float breaks the arithmetic that sizes batches from it
        raise ValueError(f"{name}={value!r} is not a finite byte count; give a number of bytes such as '80GiB'")
    result = int(scaled)
    if result <= 0:
        less = f" (less than one byte: did you mean '{str(value).strip()}GiB'?)" if 0 < scaled < 1 and unit == "" else ""
        raise ValueError(f"{name} must be positive, got {value!r}{less}")
    return result


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
