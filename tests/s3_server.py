"""A faulty S3 front for the fault tests: an HTTP proxy before a moto_server that can answer
errors, hold requests, and counts what it did.

tensorstore's ``s3`` driver talks to :class:`FaultyS3Proxy` as to any S3 endpoint; each request
is forwarded to the real server (``jax_mlpo.testing.s3_server.S3Server``) unless the proxy was told
to answer the next ones with a 5xx (:meth:`FaultyS3Proxy.fail_next`) or to hold them
(:meth:`FaultyS3Proxy.hold`, as a server slower than any timeout) until released.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse

# hop-by-hop headers (RFC 9110 7.6.1) and those the proxy sets itself
_SKIP = {"connection", "keep-alive", "transfer-encoding", "expect", "te", "content-length"}


class FaultyS3Proxy:
    """An HTTP proxy on 127.0.0.1 before ``upstream`` (an S3 endpoint URL).

    Attributes:
      endpoint: the proxy's URL, to give ``ObjectTier.endpoint``.
      forwarded: requests forwarded to the server and answered by it.
      errors: requests the proxy answered with an error itself.
      held: requests waiting in :meth:`hold` now.
    """

    def __init__(self, upstream: str) -> None:
        self._upstream = urllib.parse.urlparse(upstream).netloc
        self._lock = threading.Lock()
        self._fail: list[int] = []  # the statuses of the next requests to refuse
        self._open = threading.Event()
        self._open.set()
        self._hold_limit_s = 60.0
        self.forwarded = 0
        self.errors = 0
        self.held = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" for large PUTs

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status = proxy._take_failure()
                if status is not None:
                    self._answer(status, [("Content-Type", "application/xml")], _error(status))
                    return
                with proxy._lock:
                    proxy.held += 1
                try:
                    proxy._open.wait(proxy._hold_limit_s)
                finally:
                    with proxy._lock:
                        proxy.held -= 1
                upstream = http.client.HTTPConnection(proxy._upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _SKIP}
                    upstream.request(self.command, self.path, body, headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                    kept = [(k, v) for k, v in reply.getheaders() if k.lower() not in _SKIP]
                    length = reply.getheader("Content-Length")
                finally:
                    upstream.close()
                with proxy._lock:
                    proxy.forwarded += 1
                self._answer(reply.status, kept, data, length)

            def _answer(
                self, status: int, headers: list[tuple[str, str]], data: bytes,
                length: str | None = None,
            ) -> None:  # fmt: skip
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                # a HEAD answer gives the object's length and no body
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _take_failure(self) -> int | None:
        with self._lock:
            if not self._fail:
                return None
            self.errors += 1
            return self._fail.pop(0)

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answers the next ``n`` requests with ``status`` (and S3's error body) itself, in
        place of any failures still to come (0: none)."""
        with self._lock:
            self._fail = [status] * n

    def hold(self, limit_s: float = 60.0) -> None:
        """Holds every request from now until :meth:`release` (a server that stops answering),
        or ``limit_s`` at most, so that a client that never gives up fails its test rather
        than hanging it."""
        self._hold_limit_s = limit_s
        self._open.clear()

    def release(self) -> None:
        """Forwards the held requests and the next ones again."""
        self._open.set()

    def close(self) -> None:
        """Releases what it holds and stops listening."""
        self.release()
        self._server.shutdown()
        self._server.server_close()


def _error(status: int) -> bytes:
    code = {500: "InternalError", 503: "SlowDown"}.get(status, "ServiceUnavailable")
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>injected by the test proxy</Message></Error>"
    ).encode()
