"""Config values: byte counts and rates ("8GiB", "600MB/s"), string options, mapping keys.

Shared by :mod:`jax_mlpo.config`, :mod:`jax_mlpo.object_tier` and
:mod:`jax_mlpo.tier_settings` (below them all, so none imports another for them).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Iterable, Mapping
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


def check_choice(value: Any, choices: Any, field: str, why: str = "", where: str = "") -> None:
    """Checks a string option against the values of its ``Literal`` type.

    Args:
      value: the option's value.
      choices: the option's ``Literal`` type, e.g. ``Literal["aio", "threads"]``.
      field: the option, as the error names it (``"FileTier.io_submit"``).
      why: what the values mean, appended to the error.
      where: whose option it is (a tier's path), for the error.

    Raises:
      ConfigError: naming the field, the value and the allowed values.
    """
    allowed = typing.get_args(choices)
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(
            f"{field}={value!r}{f' for {where}' if where else ''}: must be one of {allowed}"
            + (f"; {why}" if why else "")
        )


def check_keys(
    cls: type, data: Mapping[str, Any], where: str, also: Iterable[str] = ()
) -> dict[str, Any]:
    """``data`` as keyword arguments of dataclass ``cls``.

    Args:
      cls: the dataclass.
      data: its fields' values by name.
      where: the mapping's place in the config, for the error.
      also: keys the caller accepts besides the fields (named in the error as valid).

    Raises:
      ConfigError: on an unknown key, listing the valid ones.
    """
    names = {f.name for f in dataclasses.fields(cls)} | set(also)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(names)}")
    return dict(data)
