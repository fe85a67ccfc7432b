"""Offload configuration: where the optimizer state lives and how it moves.

Everything here is plain data, validated when it is built (sizes, types) and again, against the
file system, by :meth:`OffloadConfig.validate` before the optimizer is constructed. Each error
names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jax_mlpo.errors import ConfigError
from jax_mlpo.tiers.file_tier import FileTier, IoEngine, IoMode, IoSubmit
from jax_mlpo.tiers.object_tier import ObjectTier
from jax_mlpo.tiers.settings import (
    FLAT_KEYS,
    Bandwidth,
    TierLimits,
    check_choice,
    check_keys,
    nest,
    parse_size,
)

__all__ = [
    "Bandwidth",
    "ConfigError",
    "FileTier",
    "IoEngine",
    "IoMode",
    "IoSubmit",
    "ObjectTier",
    "OffloadConfig",
    "TierLimits",
    "parse_size",
]


Placement = Literal["measured", "even", "first"]
Order = Literal["alternate", "ascending"]
OverlapOrder = Literal["forward", "alternate"]
RetainPolicy = Literal["equal", "slow_tiers"]


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer's state lives and how it streams.

    Attributes:
      host_cache: host memory budget in bytes (or a string like ``"8GiB"``) for the pipeline's
        buffers plus the subgroups kept resident in host memory. If it holds the whole state,
        no file tier is used.
      tiers: file tiers holding the subgroups that do not fit in ``host_cache``.
      subgroup_size: elements per subgroup, the unit of I/O and compute. A parameter may span
        subgroups.
      prefetch_depth: reads in flight per tier ahead of the subgroup being updated
        (0: synchronous).
      placement: ``"measured"`` (subgroups split by each tier's measured or given bandwidth,
        interleaved), ``"even"`` (split evenly, interleaved) or ``"first"`` (everything on the
        first tier: one path, the baseline).
      order: ``"alternate"`` (ascending, then descending, ...) or ``"ascending"`` every step.
      overlap_order: the order of updates beside the forward pass
        (:func:`jax_mlpo.overlapped_step`) under ``order="alternate"``: ``"forward"`` every one
        in the forward pass's order, what the last one kept in host memory first (the plain
        step's bytes: :func:`jax_mlpo.engine.retention.cached_first`), or ``"alternate"``
        every other one reversed (the same bytes; that update not beside the forward pass).
      retain: keep the subgroups the next step starts with in host memory across the step
        boundary, not written back: with the alternating order one per host buffer (the next
        step updates them before it reads anything into their buffers), with ``"ascending"``
        as many as ``host_cache`` allows beyond the pipeline's buffers.
      retain_policy: ``"equal"`` (the same count per tier, as the MLP-Offload artifact) or
        ``"slow_tiers"`` (retain the slowest tier's subgroups first). Placement accounts for
        either, so both give the same I/O bound; ``"equal"`` spreads each tier's I/O evenly over
        the step instead of idling the slow tier at the end (docs/benchmarks.md, "Update
        phase", has both).
      delayed_conversion: keep bf16 gradients in host memory and convert them inside the
        update. When False (the baseline), fp32 gradients are written to the tier before the
        update and read back in it, as ZeRO-Infinity does.
      replan: re-plan placement when a tier's observed I/O time stays more than 25% off the
        model for 3 steps; moved subgroups migrate on their next write-back.
      write_behind: an update returns once every subgroup is updated; the write-backs still in
        flight finish while the caller goes on (the next forward and backward pass), and the
        next update, ``flush``, checkpoint or ``close`` waits for them first (and reports their
        errors). When False, each update waits for its last write.
      read_ahead: between updates (the forward and backward pass), read the next update's
        first subgroups into the host buffers that hold nothing it needs sooner: empty ones,
        and those freed by write-backs. Its order is known and the state it reads does not
        change before it, so the reads start as soon as a buffer is free instead of when the
        update does. It only uses buffers within ``host_cache``; with the alternating order
        and ``retain`` every buffer already holds a subgroup the next update starts with, and
        there is nothing to read ahead.
      node_permits_dir: directory of the node-level permits of tiers with
        ``node_max_concurrency`` (node-local, e.g. ``/dev/shm/jax_mlpo``).
      fallback_on_full: when a tier runs out of space (ENOSPC), write the subgroup to another
        tier with room instead of failing the update.
      io_timeout_s: seconds a tier request may take before the update fails with an error
        naming the tier (instead of hanging on a dead file system); None waits forever.
    """

    host_cache: int | str = "1GiB"
    tiers: tuple[FileTier | ObjectTier, ...] = ()
    subgroup_size: int = 100_000_000
    prefetch_depth: int = 2
    placement: Placement = "measured"
    order: Order = "alternate"
    overlap_order: OverlapOrder = "forward"
    retain: bool = True
    retain_policy: RetainPolicy = "equal"
    delayed_conversion: bool = True
    replan: bool = True
    write_behind: bool = True
    read_ahead: bool = True
    node_permits_dir: str = "/dev/shm/jax_mlpo"
    fallback_on_full: bool = True
    io_timeout_s: float | None = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_cache", parse_size(self.host_cache, "host_cache"))
        if self.host_cache < 0:
            raise ConfigError(f"host_cache={self.host_cache!r} must be >= 0 bytes")
        if isinstance(self.tiers, FileTier | ObjectTier | str | os.PathLike) or not isinstance(
            self.tiers, Sequence
        ):
            raise ConfigError(
                f"tiers={self.tiers!r} must be a list of FileTier or ObjectTier (or of paths), "
                f"e.g. tiers=[FileTier({str(self.tiers)!r})]"
            )
        tiers = tuple(_as_tier(t) for t in self.tiers)
        object.__setattr__(self, "tiers", tiers)
        if not isinstance(self.subgroup_size, int) or isinstance(self.subgroup_size, bool):
            raise ConfigError(f"subgroup_size={self.subgroup_size!r} must be an int (elements)")
        if self.subgroup_size <= 0:
            raise ConfigError(
                f"subgroup_size={self.subgroup_size} must be positive (elements per subgroup, "
                "e.g. 100_000_000)"
            )
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ConfigError(
                f"prefetch_depth={self.prefetch_depth!r} must be an int >= 0 (0 = synchronous)"
            )
        check_choice(self.placement, Placement, "placement")
        check_choice(self.order, Order, "order")
        check_choice(self.overlap_order, OverlapOrder, "overlap_order")
        check_choice(self.retain_policy, RetainPolicy, "retain_policy")
        if self.io_timeout_s is not None and not (
            isinstance(self.io_timeout_s, int | float) and self.io_timeout_s > 0
        ):
            raise ConfigError(
                f"io_timeout_s={self.io_timeout_s!r} must be a positive number of seconds or None"
            )
        for name in (
            "retain",
            "delayed_conversion",
            "replan",
            "write_behind",
            "read_ahead",
            "fallback_on_full",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        seen: dict[str, str] = {}
        for tier in tiers:
            key = tier.path if isinstance(tier, ObjectTier) else os.path.realpath(
                os.path.expanduser(tier.path))  # fmt: skip
            if key in seen:
                raise ConfigError(
                    f"tiers: {tier.path!r} and {seen[key]!r} are the same place; give each "
                    "tier its own directory or prefix"
                )
            seen[key] = tier.path

    def baseline(self) -> OffloadConfig:
        """This config with every MLP-Offload principle off (ZeRO-Infinity-like).

        One path (the first tier), ascending order every step, nothing retained across steps,
        fp32 gradients written to the tier and read back in the update, no re-planning, each
        update waiting for its last write, no reads before an update starts.
        """
        return dataclasses.replace(
            self,
            placement="first",
            order="ascending",
            retain=False,
            delayed_conversion=False,
            replan=False,
            write_behind=False,
            read_ahead=False,
        )

    def validate(self) -> None:
        """Checks every tier: file tiers against the file system (:meth:`FileTier.validate`),
        object tiers with a small write and read (:meth:`ObjectTier.validate`)."""
        for tier in self.tiers:
            tier.validate()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OffloadConfig:
        """Builds a config from a dict (e.g. parsed YAML); tiers may be dicts or path strings.

        Raises:
          ConfigError: on an unknown key (with the valid ones) or an invalid value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"offload config must be a mapping, got {type(data).__name__}")
        return cls(**check_keys(cls, data, "offload"))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> OffloadConfig:
        """Loads :meth:`from_dict` input from a YAML file."""
        import yaml

        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {})


def _as_tier(tier: Any) -> FileTier | ObjectTier:
    """A tier from a config value: a tier, a path (``s3://`` URLs are object tiers) or a
    mapping (with ``url`` or ``kvstore``: an object tier; with ``path``: a file tier), whose
    limits and bandwidth may be nested or flat (:func:`jax_mlpo.tiers.settings.nest`)."""
    if isinstance(tier, FileTier | ObjectTier):
        return tier
    if isinstance(tier, str | os.PathLike):
        text = os.fspath(tier)
        return ObjectTier(text) if text.startswith("s3://") else FileTier(text)
    if isinstance(tier, Mapping):
        cls = ObjectTier if "url" in tier or "kvstore" in tier else FileTier
        name = tier.get("url") or tier.get("path")
        where = f"tiers[] ({name})" if isinstance(name, str) else "tiers[]"
        return cls(**check_keys(cls, nest(tier, where), where, also=FLAT_KEYS))
    raise ConfigError(f"tiers: {tier!r} is not a FileTier, an ObjectTier, a path or a mapping")
