"""Byte sizes as people and Kubernetes write them: `6GiB`, `512Mi`, `1.5G`, `4096`.

Binary suffixes (Ki, Mi, Gi, Ti, with or without a trailing B) are powers of 1024; decimal
ones (k, K, M, G, T, with or without B) powers of 1000, as in Kubernetes quantities. A bare
number is bytes. Anything else is refused with the text that could not be read.
"""

from __future__ import annotations

import re

from openrl_core.errors import InvalidRequest

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    if isinstance(text, int):
        if text < 0:
            raise InvalidRequest(f"a byte size cannot be negative: {text}")
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidRequest(f"{text!r} is not a byte size (e.g. 6GiB, 512Mi, 2G or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[unit])
