"""Byte sizes as people type them (`23.44G`, `512M`, `30%`) and as the plan prints them.

Units are binary (1G = 2**30 bytes), as GPU memory is reported; a bare number is bytes.
A trailing `%` is kept as a fraction, for options that are relative to the experts' size.
"""

from __future__ import annotations

import re

from strata.errors import BadOption

UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_size(text, flag: str, allow_zero: bool = False) -> int:
    """Bytes from `23.44G` / `512M` / `4096`; a clear error naming `flag` otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise BadOption(f"{flag} {text!r} is not a size",
                            f"write it like 23.44G, 512M or a number of bytes, e.g. {flag} 8G")
        value = int(float(m.group(1)) * UNITS[m.group(2).upper()])
    if value < 0 or (value == 0 and not allow_zero):
        raise BadOption(f"{flag} must be {'zero or more' if allow_zero else 'positive'}, got {text!r}",
                        f"give a size such as {flag} 512M")
    return value


def parse_fraction(text) -> float | None:
    """`30%` -> 0.3; None when `text` is not a percentage."""
    m = _PERCENT.match(str(text))
    return float(m.group(1)) / 100 if m else None


def format_size(n: float) -> str:
    """Short human form: 1.50 GiB, 12.0 MiB, 512 B."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
