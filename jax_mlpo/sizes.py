"""Byte counts and rates in configs ("8GiB", "600MB/s").

Shared by :mod:`jax_mlpo.config` and :mod:`jax_mlpo.object_tier` (below both, so neither
imports the other for them).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from jax_mlpo.errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*(?:/S)?\s*$")


def parse_size(value: int | float | str, field: str) -> int:
    """Parses a byte count such as ``8589934592``, ``"8GiB"``, ``"600MB"`` or ``"600MB/s"``.

    Args:
      value: an int (bytes), a float, or a string with an optional decimal (KB, MB, GB, TB) or
        binary (KiB, MiB, GiB, TiB) unit, case-insensitive.
      field: the config field, for the error message.

    Returns:
      The number of bytes, as an int.

    Raises:
      ConfigError: if the value is not a size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r} is not a size; give bytes or a string like '8GiB'")
    if isinstance(value, int | float | str):
        if isinstance(value, str):
            match = _SIZE_RE.match(value.upper())
            number = float(match.group(1)) * _UNITS[match.group(2)] if match and (
                match.group(2) in _UNITS) else None  # fmt: skip
        else:
            number = value
        if number is not None and math.isfinite(number):
            return int(number)
    raise ConfigError(
        f"{field}={value!r} is not a size; give bytes (an int) or a string like '8GiB' or '600MB'"
    )


_RATES = (
    ("bandwidth_cap", "for no cap"),
    ("node_bandwidth_cap", "for no cap"),
    ("read_bandwidth", "to measure it"),
    ("write_bandwidth", "to measure it"),
)


def parse_rates(tier: Any, kind: str) -> None:
    """Validates a tier config's rates and node permits in place (a frozen dataclass).

    The fields every tier kind shares: ``bandwidth_cap``, ``node_bandwidth_cap``,
    ``read_bandwidth``, ``write_bandwidth`` (bytes/s, parsed), ``node_max_concurrency`` and
    ``node_permits``.

    Raises:
      ConfigError: naming ``kind``, the field, the tier's path and the fix.
    """
    where = tier.path
    for name, none_means in _RATES:
        value = getattr(tier, name)
        if value is not None:
            rate = parse_size(value, f"{kind}.{name} ({where})")
            if rate <= 0:
                raise ConfigError(
                    f"{kind}.{name}={value!r} for {where}: must be positive "
                    f"(bytes/s, e.g. '600MB'), or None {none_means}"
                )
            object.__setattr__(tier, name, rate)
    if not isinstance(tier.max_concurrency, int) or tier.max_concurrency < 1:
        raise ConfigError(
            f"{kind}.max_concurrency={tier.max_concurrency!r} for {where}: must be an "
            "int >= 1 (use 1 for a shared parallel file system)"
        )
    node = tier.node_max_concurrency
    if node is not None and (not isinstance(node, int) or node < 1):
        raise ConfigError(
            f"{kind}.node_max_concurrency={node!r} for {where}: "
            "must be an int >= 1, or None for no node-level limit"
        )
    if tier.node_permits not in ("tier", "direction"):
        raise ConfigError(
            f"{kind}.node_permits={tier.node_permits!r} for {where}: must be 'tier' "
            "(reads and writes share node_max_concurrency) or 'direction' (each has it)"
        )


def check_keys(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` as keyword arguments of dataclass ``cls``.

    Raises:
      ConfigError: on an unknown key, listing the valid ones.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(names)}")
    return dict(data)
