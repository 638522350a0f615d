"""A real S3 server on this machine for the object-storage tests: moto's ``ThreadedMotoServer``
on 127.0.0.1 (a free port), with a fault layer in front of its WSGI app.

The fault layer counts every request by method and path (``server.count("GET", "/bkt/k")``) and
applies the rules a test adds (``server.fail(...)``): an HTTP error (503 SlowDown, 403
AccessDenied), a connection dropped before the response or in the middle of its body, a delay
before the response, or a hook run before the request is served. Each rule applies a bounded
number of times (``times``) or until removed. Nothing here reaches any address but 127.0.0.1.

A rule may also match on the query string (``query=``: a listing of one prefix is
``GET /bucket?list-type=2&prefix=...``), and answer in the server's place (``server.answer(...)``):
a page that is not XML, or the pages of a :class:`VirtualFolder`, a folder of any size (a
paginator that never ends, one that repeats its token) that exists only in its listings.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.server import ThreadedMotoServer
from werkzeug.serving import make_server

ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{message}</Message><RequestId>fault</RequestId></Error>"
)


@dataclass
class Rule:
    method: str
    match: Callable[[str], bool]
    kind: str  # "status", "drop", "cut", "delay", "hook", "redirect", "trickle"
    times: int | None  # None: until removed
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0
    hook: Callable[[str], None] | None = None
    query: Callable[[str], bool] | None = None  # also matched on the query string
    answer: Callable[[dict], tuple[int, bytes]] | None = None  # "answer": status and body


class FaultLayer:
    """WSGI middleware: counts requests, applies the fault rules, passes the rest to moto."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.rules: list[Rule] = []
        self.closing = threading.Event()  # cuts delays short when the server stops

    def __call__(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with self.lock:
            self.counts[(method, path)] += 1
            rule = next(
                (
                    r
                    for r in self.rules
                    if r.method in (method, "*")
                    and r.match(path)
                    and (r.query is None or r.query(environ.get("QUERY_STRING", "")))
                ),
                None,
            )
            if rule is not None and rule.times is not None:
                rule.times -= 1
                if rule.times <= 0:
                    self.rules.remove(rule)
        if rule is None:
            return self.app(environ, start_response)
        if rule.kind == "status":
            body = ERROR_XML.format(code=rule.code, message=f"injected {rule.code}").encode()
            start_response(
                f"{rule.status} Injected",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [body]
        if rule.kind == "answer" and rule.answer is not None:  # the server's reply, made here
            status, body = rule.answer(environ)
            start_response(
                f"{status} Answered",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [body]
        if rule.kind == "drop":  # the connection goes before any response
            sock = environ.get("werkzeug.socket")
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionAbortedError("fault layer: connection dropped")
        if rule.kind == "delay":
            self.closing.wait(rule.seconds)  # a slow server, not a synchronisation
        elif rule.kind == "hook" and rule.hook is not None:
            rule.hook(path)
        elif isinstance(rule, Redirect):  # another server's address for the object
            start_response(
                f"{rule.status} Redirect",
                [("Location", rule.location + path), ("Content-Length", "0")],
            )
            return [b""]
        elif rule.kind == "trickle":  # moto's answer, its body one byte every `seconds`
            return self._trickle(rule, environ, start_response)
        if rule.kind == "cut":  # half the body, then the connection goes
            chunks = []
            status_headers = {}

            def keep(status, headers, exc_info=None):
                status_headers.update(status=status, headers=headers)
                return chunks.append

            for part in self.app(environ, keep):
                chunks.append(part)
            body = b"".join(chunks)
            start_response(status_headers["status"], status_headers["headers"])
            return _cut(body)
        return self.app(environ, start_response)

    def _trickle(self, rule: Rule, environ, start_response) -> Iterator[bytes]:
        answered: dict = {}

        def keep(status, headers, exc_info=None):
            answered.update(status=status, headers=headers)
            return lambda data: None

        body = b"".join(self.app(environ, keep))
        start_response(answered["status"], answered["headers"])
        for k in range(len(body)):
            if self.closing.wait(rule.seconds):  # a slow link, cut short when the server stops
                return
            yield body[k : k + 1]


def listing_page(
    bucket: str,
    prefix: str,
    keys: list[tuple[str, int]],
    *,
    token: str | None = None,
    prefixes: tuple[str, ...] = (),
) -> bytes:
    """A ListObjectsV2 answer (keys URL-encoded, as asked by botocore's ``encoding-type=url``);
    ``token``: truncated, with this continuation token."""
    contents = "".join(
        f"<Contents><Key>{quote(k)}</Key><Size>{n}</Size><ETag>&quot;{n:032x}&quot;</ETag>"
        "<LastModified>2026-01-01T00:00:00.000Z</LastModified>"
        "<StorageClass>STANDARD</StorageClass></Contents>"
        for k, n in keys
    )
    common = "".join(
        f"<CommonPrefixes><Prefix>{quote(p)}</Prefix></CommonPrefixes>" for p in prefixes
    )
    more = f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult '
        'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{bucket}</Name><Prefix>{quote(prefix)}</Prefix><KeyCount>{len(keys)}</KeyCount>"
        f"<MaxKeys>1000</MaxKeys><EncodingType>url</EncodingType>"
        f"<IsTruncated>{'true' if token else 'false'}</IsTruncated>{more}{contents}{common}"
        "</ListBucketResult>"
    ).encode()


class VirtualFolder:
    """The listings of ``count`` objects ``<prefix>/<class>/<i:010d>.jpg`` (``size`` bytes each)
    that exist nowhere else: answers ListObjectsV2 for the prefix (its class folders, with
    ``delimiter=/``) and for each class folder, paged by ``page`` keys, from a continuation
    token or ``start-after``. ``count=None`` is a paginator that never ends; ``repeat=True``
    answers every page with the first page's token (a listing that repeats itself)."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        count: int | None,
        *,
        classes: tuple[str, ...] = ("c",),
        size: int = 1000,
        page: int = 1000,
        repeat: bool = False,
    ) -> None:
        self.bucket, self.prefix, self.count, self.classes = bucket, prefix, count, classes
        self.size, self.page, self.repeat = size, page, repeat

    def matches(self, query: str) -> bool:
        q = parse_qs(query)
        return "list-type" in q and q.get("prefix", [""])[0].startswith(self.prefix)

    def __call__(self, environ: dict) -> tuple[int, bytes]:
        q = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        prefix = q.get("prefix", "")
        if q.get("delimiter") == "/" and prefix == self.prefix + "/":
            folders = tuple(f"{prefix}{c}/" for c in self.classes)
            return 200, listing_page(self.bucket, prefix, [], prefixes=folders)
        cls = prefix[len(self.prefix) + 1 :].rstrip("/")
        if cls not in self.classes:
            return 200, listing_page(self.bucket, prefix, [])
        folder = f"{self.prefix}/{cls}/"
        n = self.count if self.count is not None else 10**9
        if "continuation-token" in q:
            start = int(q["continuation-token"])
        else:  # the first key after start-after
            after = q.get("start-after", "")
            start = bisect_right(range(n), after, key=lambda i: f"{folder}{i:010d}.jpg")
        stop = min(n, start + min(self.page, int(q.get("max-keys", 1000))))
        keys = [(f"{folder}{i:010d}.jpg", self.size) for i in range(start, stop)]
        token = "0" if self.repeat else (str(stop) if stop < n or self.count is None else None)
        return 200, listing_page(self.bucket, prefix, keys, token=token)


def _cut(body: bytes) -> Iterator[bytes]:
    yield body[: len(body) // 2]
    raise ConnectionResetError("fault layer: body cut")


class S3Server(ThreadedMotoServer):
    """moto's threaded server on 127.0.0.1 behind a :class:`FaultLayer`."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.faults = FaultLayer(DomainDispatcherApplication(create_backend_app))

    def _server_entry(self) -> None:
        self._server = make_server(
            self._ip_address,
            self._port,
            self.faults,
            True,
            request_handler=MotoRequestHandler,
        )
        self._server_ready_event.set()
        self._server.serve_forever()

    def start(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        super().start()

    def stop(self) -> None:
        self.faults.closing.set()
        super().stop()

    @property
    def endpoint(self) -> str:
        host, port = self.get_host_and_port()
        assert host == "127.0.0.1", host
        return f"http://{host}:{port}"

    def env(self, secret: str = "gpucache-test-secret") -> dict[str, str]:
        """The standard variables a client reads, pointing at this server only."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "gpucache-test-key",
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never ask an instance metadata address
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    # ------------------------------------------------------------------ counting and faults
    def count(self, method: str = "GET", path: str | None = None) -> int:
        with self.faults.lock:
            return sum(
                n
                for (m, p), n in self.faults.counts.items()
                if m == method and (path is None or p == path)
            )

    def gets(self, prefix: str) -> Counter:
        """GET requests per object path under ``prefix`` (``/bucket/key...``)."""
        with self.faults.lock:
            return Counter(
                {
                    p: n
                    for (m, p), n in self.faults.counts.items()
                    if m == "GET" and p.startswith(prefix) and "?" not in p
                }
            )

    def reset_counts(self) -> None:
        with self.faults.lock:
            self.faults.counts.clear()

    def fail(
        self,
        kind: str,
        match: str | Callable[[str], bool],
        *,
        method: str = "GET",
        times: int | None = 1,
        status: int = 503,
        location: str = "",
        code: str = "SlowDown",
        seconds: float = 0.0,
        hook: Callable[[str], None] | None = None,
    ) -> Rule:
        test = match if callable(match) else (lambda p, m=match: m in p)
        if kind == "redirect":  # to ``location`` + the request's path (another server's)
            rule: Rule = Redirect(
                method, test, kind, times, status, code, seconds, hook, location=location
            )
        else:
            rule = Rule(method, test, kind, times, status, code, seconds, hook)
        with self.faults.lock:
            self.faults.rules.append(rule)
        return rule

    def fail_listing(
        self,
        kind: str,
        prefix: str,
        *,
        bucket: str = "bkt",
        times: int | None = 1,
        status: int = 503,
        code: str = "SlowDown",
        seconds: float = 0.0,
    ) -> Rule:
        """A fault on the listings of ``prefix`` (``ListObjectsV2`` with a prefix starting so)."""

        def listing_of(query: str) -> bool:
            q = parse_qs(query)
            return "list-type" in q and q.get("prefix", [""])[0].startswith(prefix)

        rule = Rule("GET", lambda p: p.rstrip("/") == f"/{bucket}", kind, times, status, code)
        rule.seconds, rule.query = seconds, listing_of
        with self.faults.lock:
            self.faults.rules.append(rule)
        return rule

    def answer(
        self,
        answer: Callable[[dict], tuple[int, bytes]],
        query: Callable[[str], bool],
        *,
        bucket: str = "bkt",
        times: int | None = None,
    ) -> Rule:
        """Requests on ``bucket`` whose query string ``query`` accepts are answered by
        ``answer(environ) -> (status, body)`` instead of moto (a garbage page, a
        :class:`VirtualFolder`)."""
        rule = Rule("GET", lambda p: p.rstrip("/") == f"/{bucket}", "answer", times)
        rule.query, rule.answer = query, answer
        with self.faults.lock:
            self.faults.rules.append(rule)
        return rule

    def lists(self, bucket: str = "bkt") -> int:
        """Listing requests (``GET /bucket?...``) served or faulted so far."""
        return self.count("GET", f"/{bucket}") + self.count("GET", f"/{bucket}/")

    def clear_faults(self) -> None:
        with self.faults.lock:
            self.faults.rules.clear()

    @contextmanager
    def faulty(self) -> Iterator[S3Server]:
        """Rules added inside are removed at the end, whatever happened."""
        try:
            yield self
        finally:
            self.clear_faults()


@contextmanager
def serving(bucket: str, objects: Mapping[str, bytes]) -> Iterator[tuple[S3Server, Any]]:
    """A started server with its environment set (undone after), ``bucket`` made and
    ``objects`` (keys within the bucket) uploaded: ``(server, s3fs filesystem)``; stopped after.
    A bucket an earlier server of this process made is taken as it is (moto keeps its buckets
    per process, past its server)."""
    import pytest
    import s3fs

    server = S3Server()
    server.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in server.env().items():
                mp.setenv(k, v)
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            fs.pipe({f"{bucket}/{k}": v for k, v in objects.items()})
            yield server, fs
    finally:
        server.stop()


@dataclass
class Redirect(Rule):
    """A ``"redirect"`` rule: answers ``status`` with ``Location: <location><path>``."""

    location: str = ""


class Stranger:
    """Another HTTP server on 127.0.0.1, the target of a ``"redirect"`` rule: it answers every
    GET of a path with ``body(path)`` (say other bytes of the object's listed size) and keeps
    the requests it gets (``requests``: paths; ``headers``: their headers)."""

    def __init__(self, body: Callable[[str], bytes]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        stranger = self
        self.requests: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the handler's name in http.server
                with stranger.lock:
                    stranger.requests.append(self.path)
                    stranger.headers.append(dict(self.headers))
                data = body(self.path.split("?", 1)[0])
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # no line per request
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> Stranger:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=30)
