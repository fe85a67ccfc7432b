"""A local S3 protocol server (moto_server), to run an :class:`~jax_mlpo.ObjectTier` against in
tests and benchmarks, with no store of one's own::

    with jax_mlpo.testing.s3_server.dummy_credentials():
        server = jax_mlpo.testing.s3_server.S3Server().start()
        tier = jax_mlpo.ObjectTier(f"s3://{server.bucket()}/run/", endpoint=server.endpoint,
                                   region="us-east-1")
        ...
        server.kill()

``moto[server]`` (the test and experiments extras) speaks the S3 REST protocol on 127.0.0.1;
tensorstore's ``s3`` kvstore driver talks to it as to any S3-compatible store. Credentials are
dummies in the environment (tensorstore's ``environment`` credentials); buckets are created
with a plain PUT, as tensorstore's own tests do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

from jax_mlpo.testing.processes import free_port

DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class S3Server:
    """A moto_server process at a free port: :meth:`start`, :meth:`kill` (as a crash).

    Args:
      check_credentials: refuse requests whose access key moto does not know (after the
        first request, which creates a bucket): moto accepts any key otherwise.
    """

    def __init__(self, check_credentials: bool = False) -> None:
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        # moto's switch: the first N requests go unauthenticated, then every one is checked
        self._env = (
            {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "1"} if check_credentials else None
        )

    def start(self, timeout_s: float = 60.0) -> S3Server:
        """Starts the server and waits until it accepts connections.

        Raises:
          RuntimeError: if it exits or does not listen within ``timeout_s``.
        """
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self._env,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as probe:  # a bare connect: no request moto would count
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"moto_server did not listen within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL: the server and every object in it are gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        name = f"b-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()
        return name


@contextlib.contextmanager
def dummy_credentials():
    """The dummy credentials in ``os.environ`` for the duration (restored after)."""
    saved = {k: os.environ.get(k) for k in DUMMY_CREDENTIALS}
    os.environ.update(DUMMY_CREDENTIALS)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
