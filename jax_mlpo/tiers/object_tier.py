"""An object-store tier: part of the optimizer state in an S3-compatible bucket.

The remote level of MLP-Offload's hierarchy, for clouds where the shared storage is an object
store. The bytes move through tensorstore's ``s3`` kvstore driver (any tensorstore kvstore
spec works); the engine treats it like a file tier: placement probes it, permits bound it,
re-planning moves subgroups to and from it.

Example::

    jax_mlpo.ObjectTier("s3://my-bucket/run1/", endpoint="http://127.0.0.1:9000",
                        region="us-east-1", credentials="environment")
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from jax_mlpo.errors import ConfigError
from jax_mlpo.tiers.settings import (
    Bandwidth,
    TierLimits,
    check_choice,
    check_settings,
    takes_flat_settings,
)

# tensorstore's aws_credentials types
Credentials = Literal["environment", "anonymous", "default", "imds", "ecs"]


@takes_flat_settings
@dataclasses.dataclass(frozen=True)
class ObjectTier:
    """A bucket prefix (or any tensorstore kvstore) that holds part of the optimizer state.

    One value per subgroup blob (``[p | m | v]`` float32) followed by its crc32c, verified on
    every read. A lock object under the prefix keeps a second run out.

    Attributes:
      url: ``"s3://bucket/prefix/"``. Give this or ``kvstore``.
      kvstore: a raw tensorstore kvstore JSON spec instead of ``url`` (``endpoint``,
        ``region`` and ``credentials`` are then taken from it).
      endpoint: the S3 endpoint, e.g. ``"http://127.0.0.1:9000"`` (None: AWS).
      region: the bucket's region (with ``endpoint``, no region lookup is made).
      credentials: ``"environment"`` (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, the
        default), ``"anonymous"``, ``"default"`` (the AWS chain), ``"imds"``, ``"ecs"``, or
        ``{"type": "profile", "profile": NAME}``.
      request_concurrency: HTTP requests in flight (tensorstore's ``s3_request_concurrency``).
      request_retries: retries of a failed request before the tier reports an error.
      limits: blobs in flight and bandwidth caps, per process and per node
        (:class:`~jax_mlpo.tiers.settings.TierLimits`).
      bandwidth: the tier's read and write bandwidth for placement; where not given, measured
        by a probe at start (:class:`~jax_mlpo.tiers.settings.Bandwidth`).

    Raises:
      ConfigError: naming the field, the value and the fix.
    """

    url: str | None = None
    kvstore: dict[str, Any] | None = None
    endpoint: str | None = None
    region: str | None = None
    credentials: Credentials | dict[str, Any] = "environment"
    request_concurrency: int = 8
    request_retries: int = 3
    limits: TierLimits = TierLimits()
    bandwidth: Bandwidth = Bandwidth()

    def __post_init__(self) -> None:
        if (self.url is None) == (self.kvstore is None):
            raise ConfigError(
                f"ObjectTier(url={self.url!r}, kvstore=...): give exactly one of url "
                "('s3://bucket/prefix/') and kvstore (a tensorstore kvstore spec)"
            )
        if self.url is not None:
            if not isinstance(self.url, str) or not self.url.startswith("s3://"):
                raise ConfigError(
                    f"ObjectTier.url={self.url!r} must look like 's3://bucket/prefix/' (or give a "
                    "tensorstore kvstore spec as kvstore=)"
                )
            bucket = self.url[len("s3://") :].split("/", 1)[0]
            if not bucket:
                raise ConfigError(f"ObjectTier.url={self.url!r} names no bucket")
        elif (
            not isinstance(self.kvstore, dict)
            or "driver" not in self.kvstore
            or (self.kvstore["driver"] == "s3" and not self.kvstore.get("bucket"))
        ):
            raise ConfigError(
                f"ObjectTier.kvstore={self.kvstore!r} must be a tensorstore kvstore spec (a dict "
                "with a 'driver', and a 'bucket' for s3: {'driver': 's3', 'bucket': ..., "
                "'path': ...})"
            )
        if not (isinstance(self.credentials, dict) and "type" in self.credentials):
            check_choice(
                self.credentials,
                Credentials,
                "ObjectTier.credentials",
                "a dict such as {'type': 'profile', 'profile': 'name'} also works",
                self.url or "kvstore",  # self.path needs valid credentials
            )
        for name in ("request_concurrency", "request_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name == "request_concurrency" else 0):
                raise ConfigError(f"ObjectTier.{name}={value!r} for {self.path}: must be an int")
        check_settings(self, "ObjectTier")

    @property
    def path(self) -> str:
        """The tier's name in metrics, errors and locks: its URL (``s3://bucket/prefix/``)."""
        spec = self.spec()
        if spec.get("driver") == "s3":
            return f"s3://{spec['bucket']}/{spec.get('path', '')}"
        return json.dumps(spec, sort_keys=True)

    @property
    def bucket(self) -> str | None:
        return self.spec().get("bucket")

    def spec(self) -> dict[str, Any]:
        """The tensorstore kvstore spec of the tier's prefix (ending in ``/``)."""
        if self.kvstore is not None:
            spec = dict(self.kvstore)
        else:
            bucket, _, prefix = self.url[len("s3://") :].partition("/")
            creds = self.credentials
            spec = {
                "driver": "s3",
                "bucket": bucket,
                "path": prefix,
                "aws_credentials": {"type": creds} if isinstance(creds, str) else dict(creds),
            }
            if self.endpoint:
                spec["endpoint"] = self.endpoint
            if self.region:
                spec["aws_region"] = self.region
        if spec.get("path") and not spec["path"].endswith("/"):
            spec["path"] += "/"
        return spec

    def context(self) -> dict[str, Any]:
        """tensorstore context resources: request concurrency and retries."""
        return {
            "s3_request_concurrency": {"limit": self.request_concurrency},
            "s3_request_retries": {
                "max_retries": self.request_retries,
                "initial_delay": "10ms",
                "max_delay": "1s",
            },
        }

    def for_process(self, index: int) -> ObjectTier:
        """This tier for process ``index`` of a multi-process run: ``<prefix>/proc<index>/``,
        sharing node permits with the other processes through ``limits.permits_key``."""
        return self.for_part(f"proc{index}")

    def for_part(self, name: str) -> ObjectTier:
        """This tier for one of several engines of a run: ``<prefix>/<name>/``, sharing node
        permits through ``limits.permits_key``."""
        spec = self.spec()
        spec["path"] = f"{spec.get('path', '')}{name}/"
        return dataclasses.replace(
            self, url=None, kvstore=spec, limits=self.limits.shared_by(self.path)
        )

    def validate(self) -> None:
        """Checks the endpoint, the bucket and the credentials with a small write and read.

        Raises:
          ConfigError: naming the endpoint, the bucket and the fix.
        """
        from jax_mlpo.tiers.kvstore import check_reachable  # tensorstore, loaded on use

        check_reachable(self)
