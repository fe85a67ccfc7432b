"""Config values: byte counts and rates ("8GiB", "600MB/s"), string options, mapping keys,
and the settings every kind of tier has alike: its limits and its bandwidth for placement.

:class:`~jax_mlpo.config.FileTier` and :class:`~jax_mlpo.tiers.object_tier.ObjectTier` hold the
latter as their ``limits`` and ``bandwidth`` fields::

    FileTier("/lustre/proj/run1", limits=TierLimits(max_concurrency=1, node_max_concurrency=1))
    ObjectTier("s3://bucket/run1/", bandwidth=Bandwidth(read="1GB", write="500MB"))

In a config mapping (YAML), a tier gives them nested (``limits: {max_concurrency: 1}``,
``bandwidth: {read: 1GB}``) or flat, by the names :data:`FLAT_KEYS` lists
(``max_concurrency: 1``, ``read_bandwidth: 1GB``); :func:`nest` reads both.

Shared by :mod:`jax_mlpo.config` and :mod:`jax_mlpo.tiers.object_tier` (below both, so neither
imports the other for them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from jax_mlpo.errors import ConfigError

__all__ = [
    "FLAT_KEYS",
    "Bandwidth",
    "NodePermits",
    "TierLimits",
    "check_choice",
    "check_keys",
    "check_settings",
    "nest",
    "parse_size",
]

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


NodePermits = Literal["tier", "direction"]


def _rate(value: int | float | str | None, field: str, none_means: str) -> int | None:
    """A positive rate in bytes/s from ``value`` (None stays None)."""
    if value is None:
        return None
    rate = parse_size(value, field)
    if rate <= 0:
        raise ConfigError(
            f"{field}={value!r}: must be positive (bytes/s, e.g. '600MB'), or None {none_means}"
        )
    return rate


def _count(value: Any, field: str, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{field}={value!r}: must be an int >= 1 ({hint})")


@dataclasses.dataclass(frozen=True)
class TierLimits:
    """How much of a tier's device a run may use, in this process and across the node's.

    Attributes:
      max_concurrency: blobs in flight on the tier in this process, per direction: up to this
        many reads and, on their own permits, this many writes at once.
      bandwidth_cap: bytes per second the tier may move in this process (token bucket), e.g.
        ``"600MB"``, or None for no cap. Use it to be a good neighbour on a shared file
        system, or to emulate slower storage honestly in benchmarks.
      node_max_concurrency: blobs in flight on the tier across all processes of the node
        (e.g. 1 for a shared parallel file system: one process in the tier at a time), or None
        for no node limit.
      node_permits: ``"tier"``: ``node_max_concurrency`` counts reads and writes together;
        ``"direction"``: reads and writes have ``node_max_concurrency`` each.
      node_bandwidth_cap: like ``bandwidth_cap``, but for all the node's processes together
        (one pacing clock in ``OffloadConfig.node_permits_dir``): a shared device's cap.
      permits_key: what the node-level permits and pacing clock are shared by (None: the
        tier's path). The processes of a multi-process run use parts of one tier and share
        its permits through this key.

    Raises:
      ConfigError: naming the field, the value and the fix.
    """

    max_concurrency: int = 4
    bandwidth_cap: int | str | None = None
    node_max_concurrency: int | None = None
    node_permits: NodePermits = "tier"
    node_bandwidth_cap: int | str | None = None
    permits_key: str | None = None

    def __post_init__(self) -> None:
        _count(
            self.max_concurrency,
            "TierLimits.max_concurrency",
            "use 1 for a shared parallel file system",
        )
        if self.node_max_concurrency is not None:
            _count(
                self.node_max_concurrency,
                "TierLimits.node_max_concurrency",
                "or None for no node-level limit",
            )
        check_choice(
            self.node_permits,
            NodePermits,
            "TierLimits.node_permits",
            "'tier': reads and writes share node_max_concurrency; 'direction': each has it",
        )
        # rates are given as sizes ("600MB"); the stores pace with the byte count
        for name in ("bandwidth_cap", "node_bandwidth_cap"):
            rate = _rate(getattr(self, name), f"TierLimits.{name}", "for no cap")
            object.__setattr__(self, name, rate)

    def shared_by(self, key: str) -> TierLimits:
        """These limits with node permits shared through ``key``, unless a key is set."""
        return dataclasses.replace(self, permits_key=self.permits_key or key)


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """A tier's bandwidth for placement, in bytes per second (e.g. ``"2GB"``).

    Attributes:
      read: bytes/s the tier reads; None: measured by a probe when the run starts (and
        remembered in a file tier's directory).
      write: bytes/s the tier writes; None: measured likewise.

    Raises:
      ConfigError: for a value that is not a positive rate.
    """

    read: int | str | None = None
    write: int | str | None = None

    def __post_init__(self) -> None:
        for name in ("read", "write"):
            rate = _rate(getattr(self, name), f"Bandwidth.{name}", "to measure it")
            object.__setattr__(self, name, rate)


_SETTINGS = {"limits": TierLimits, "bandwidth": Bandwidth}


def check_settings(tier: Any, kind: str) -> None:
    """Checks that a tier's ``limits`` and ``bandwidth`` are :class:`TierLimits` and
    :class:`Bandwidth`.

    Raises:
      ConfigError: naming ``kind``, the field, the tier's path and an example.
    """
    examples = {"limits": "max_concurrency=1", "bandwidth": "read='2GB', write='1GB'"}
    for name, cls in _SETTINGS.items():
        value = getattr(tier, name)
        if not isinstance(value, cls):
            raise ConfigError(
                f"{kind}.{name}={value!r} for {tier.path}: must be a {cls.__name__}, e.g. "
                f"{name}={cls.__name__}({examples[name]})"
            )


# a tier mapping's flat keys: (the tier's settings field, the setting)
FLAT_KEYS = {
    **{f.name: ("limits", f.name) for f in dataclasses.fields(TierLimits)},
    "read_bandwidth": ("bandwidth", "read"),
    "write_bandwidth": ("bandwidth", "write"),
}


def nest(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A tier mapping with its ``limits`` and ``bandwidth`` built, from nested mappings and
    the flat keys of :data:`FLAT_KEYS` (``max_concurrency: 1``, ``read_bandwidth: 2GB``).

    Args:
      data: the tier's keys, as in a YAML config.
      where: the mapping's place in the config, for errors.

    Returns:
      ``data`` with the flat keys gone and ``limits`` and ``bandwidth`` (where given) as
      :class:`TierLimits` and :class:`Bandwidth`.

    Raises:
      ConfigError: on an unknown setting, or one given both flat and nested.
    """
    out = {k: v for k, v in data.items() if k not in FLAT_KEYS}
    flat: dict[str, dict[str, Any]] = {name: {} for name in _SETTINGS}
    for key, value in data.items():
        if key in FLAT_KEYS:
            group, name = FLAT_KEYS[key]
            flat[group][name] = value
    for group, cls in _SETTINGS.items():
        given = out.get(group)
        if given is not None and not isinstance(given, Mapping | cls):
            raise ConfigError(
                f"{where}.{group}={given!r} must be a mapping of {cls.__name__} fields, "
                f"e.g. {group}: {{{dataclasses.fields(cls)[0].name}: ...}}"
            )
        # a built TierLimits or Bandwidth holds every setting: none may be given flat beside it
        names = {f.name for f in dataclasses.fields(cls)} if isinstance(given, cls) else given
        twice = sorted(set(names or ()) & set(flat[group]))
        if twice:
            raise ConfigError(
                f"{where}: {twice} given both in {group} and flat; give each setting once"
            )
        if flat[group] or isinstance(given, Mapping):
            values = check_keys(cls, {**(given or {}), **flat[group]}, f"{where}.{group}")
            try:
                out[group] = cls(**values)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
    return out


def takes_flat_settings(cls: type) -> type:
    """Lets a tier's constructor take its settings flat, as a mapping may:
    ``FileTier(path, max_concurrency=2)`` is
    ``FileTier(path, limits=TierLimits(max_concurrency=2))``."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.keys() & FLAT_KEYS.keys():
            kwargs = nest(kwargs, cls.__name__)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls
