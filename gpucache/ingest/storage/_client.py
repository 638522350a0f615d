"""Data in object storage: URLs (``s3://``, ``gs://``, ``az://``), the client, and listings.

The client is fsspec's (s3fs, gcsfs, adlfs: the optional extras ``s3``, ``gcs``, ``azure``), made
from ``storage_options`` as pandas, Hugging Face ``datasets`` and Lightning take them; credentials
come from those options or the client's own chain (environment variables, config files, instance
roles), never from gpucache. Nothing here writes a credential anywhere: names, keys, logs and
errors carry the URL (with any ``user:password@`` taken out) and the server's error code.

A :class:`Listing` is what a build fetches: every object's URL (packed, as ``PathList`` packs
paths), its size and a 64-bit hash of its ETag (S3, Azure) or generation (GCS). The node cache
keys the store on the URLs, sizes and ETags, as it keys files on path, size and mtime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._errors import ObjectStoreError
from .._build import PathList
from .._lazy import OnAccess

log = logging.getLogger(__name__)

#: URL schemes read through fsspec, and the extra that installs each one's client.
SCHEMES = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
}
#: Each extra's fsspec client (pyproject.toml's extras pin their floors).
CLIENTS = {"s3": "s3fs", "gcs": "gcsfs", "azure": "adlfs"}
MAX_CONNECTIONS = 256  # S3 connections pooled (botocore's default, 10, caps requests in flight)
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_URL_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^\s'\"]*)")
_BUCKETS = {"s3", "gcs"}  # whose bucket names never hold '@' or ':' (Azure's container@account)
CREDENTIALS_HELP = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials, an "
    "instance role), AWS_DEFAULT_REGION, and AWS_ENDPOINT_URL for a server other than AWS; or "
    "storage_options={'key': ..., 'secret': ..., 'endpoint_url': ...}",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS (a service account key file), `gcloud auth "
    "application-default login`, or the instance's service account; or storage_options="
    "{'token': ..., 'project': ...}",
    "azure": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
    "AZURE_STORAGE_CONNECTION_STRING, or storage_options={'account_name': ..., ...}",
}


def is_url(x: Any) -> bool:
    """True for a string naming an object in storage (``s3://``, ``gs://``, ``az://``...).

    Another ``scheme://`` is refused with the schemes that work (it is no local path either)."""
    if not isinstance(x, str):
        return False
    m = _URL.match(x)
    if m is None:
        return False
    if m[1].lower() not in SCHEMES:
        raise ValueError(
            f"{redact(x)}: {m[1]}:// is not a source gpucache reads; give a local path or a "
            f"URL of {', '.join(s + '://' for s in sorted(SCHEMES))}"
        )
    if _userinfo(m[1].lower(), x[m.end() :]):
        raise ValueError(
            f"{redact(x)}: this URL carries a user name or password (SCHEME://USER:PASSWORD@"
            "...), and gpucache takes no credential from a URL (it would be kept in the store's "
            "paths, its build report and the logs, and the client would not use it); give the "
            "URL without it, and the credentials the way the client reads them: "
            f"{CREDENTIALS_HELP[SCHEMES[m[1].lower()]]}"
        )
    return True


def _userinfo(scheme: str, rest: str) -> str:
    """The ``user:password@`` (or ``user@``) that begins ``rest``, a URL after its ``://``.

    A colon before the first ``/`` and before an ``@`` starts one (a password may hold ``/``:
    AWS secret keys do); an ``@`` before the first ``/`` too, where bucket names cannot hold
    one (S3, GCS; Azure's ``container@account`` is no user)."""
    at, slash, colon = rest.find("@"), rest.find("/"), rest.find(":")
    if at < 0:
        return ""
    first = len(rest) if slash < 0 else slash
    if 0 <= colon < at and colon < first:
        return rest[: at + 1]
    if at < first and SCHEMES.get(scheme) in _BUCKETS:
        return rest[: at + 1]
    return ""


def redact(text: str) -> str:
    """``text`` with any URL's ``user:password@`` part removed (what names, logs and errors
    show)."""

    def one(m: re.Match[str]) -> str:
        scheme, rest = m.group(1, 2)
        cut: str = rest[len(_userinfo(scheme[:-3].lower(), rest)) :]
        return scheme + cut

    return _URL_IN_TEXT.sub(one, text)


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


def bucket_of(url: str) -> str:
    """``s3://bucket`` of ``s3://bucket/a/b.jpg``."""
    proto, _, rest = redact(url).partition("://")
    return f"{proto}://{rest.split('/', 1)[0]}"


def filesystem(url: str, storage_options: dict[str, Any] | None) -> Any:  # fsspec: untyped
    """The fsspec file system for ``url``'s scheme, a private instance (its listings are not
    cached, so a long listing does not stay in memory; other code's instances are left alone).

    S3's own retries are turned down to one attempt, so the build's bounded retries
    (``_fetch``) are the only ones, and its connection pool raised to ``MAX_CONNECTIONS`` (opened
    as requests need them), unless ``storage_options`` sets them. Its HTTP session follows no
    redirect (``_s3http``): a GET answered with one fails, as botocore's own client does."""
    proto = protocol_of(url)
    try:
        import fsspec  # type: ignore[import-untyped]

        cls = fsspec.get_filesystem_class(proto)
    except ImportError as err:
        extra = SCHEMES.get(proto, "s3")
        raise ImportError(
            f"reading {proto}:// URLs needs fsspec and its client for {proto}, which are not "
            f"installed ({err}); install them with: pip install {CLIENTS[extra]} (a clone's extra: pip "
            f"install -e '.[{extra}]')"
        ) from err
    options = dict(storage_options or {})
    options.setdefault("use_listings_cache", False)
    if SCHEMES.get(proto) == "s3":
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        # botocore pools 10 connections by default: more requests in flight would queue for one
        config.setdefault("max_pool_connections", MAX_CONNECTIONS)
        if "http_session_cls" not in config:
            from ._s3http import session_class

            config["http_session_cls"] = session_class()
        options["config_kwargs"] = config
    try:
        fs = cls(skip_instance_cache=True, **options)
    except TypeError as err:  # an option the client does not take: say which, not the values
        raise TypeError(
            f"storage_options for {proto}:// were refused by {cls.__name__} ({err}); pass "
            f"the options {cls.__name__} documents (keys given: {sorted(options)})"
        ) from None
    if SCHEMES.get(proto) == "s3" and "retries" not in options:
        fs.retries = 1  # s3fs retries some errors 5 times itself: the build's retries count
    return fs


def strip(url: str) -> str:
    """The client's path of a URL (``bucket/key``)."""
    return redact(url).split("://", 1)[1]


def error_code(err: BaseException) -> tuple[str, int]:
    """The storage service's error code and HTTP status behind ``err`` ("", 0 if none)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore's ClientError
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return str(response.get("Error", {}).get("Code", "")), int(status or 0)
        name = type(e).__name__
        code = getattr(e, "code", None)
        if name == "HttpError" and isinstance(code, int):  # gcsfs: the service's status
            return str(getattr(e, "message", "") or code), code
        status = getattr(e, "status", None)  # aiohttp: a response's status (not a payload
        if name == "ClientResponseError" and isinstance(status, int):  # error's local code)
            return str(status), status
        azure = getattr(e, "error_code", None)  # azure-core's HttpResponseError (adlfs)
        if isinstance(azure, str) and isinstance(getattr(e, "status_code", None), int):
            return azure, int(e.status_code)  # type: ignore[attr-defined]
        e = e.__cause__ or e.__context__
    return "", 0


def _location(err: BaseException) -> str:
    """Where a redirect answer pointed (scheme, host, port and path; no query, no user), or ""."""
    from urllib.parse import urlsplit

    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore's ClientError: the answer's headers
            headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            where = urlsplit(str(headers.get("location", "")))
            if where.netloc:
                return f"{where.scheme}://{where.netloc.rpartition('@')[2]}{where.path}"
        e = e.__cause__ or e.__context__
    return ""


def describe(err: BaseException) -> str:
    """A short reason for ``err``: the service's code and message, no request details; for a
    redirect, where it pointed (it is not followed)."""
    code, status = error_code(err)
    text = redact(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    parts = [type(err).__name__]
    if status:
        parts.append(f"HTTP {status}")
    if code and code != str(status) and code not in text:
        parts.append(code)
    if 300 <= status < 400:
        where = _location(err)
        return (
            f"the server answered with a redirect{' to ' + where if where else ''} "
            f"({', '.join(parts)}), which is not followed: objects are read from the "
            "endpoint alone; check the endpoint (AWS_ENDPOINT_URL, endpoint_url) and the "
            "bucket's region"
        )
    return f"{text} ({', '.join(parts)})"


def access_error(url: str, err: BaseException, what: str = "list") -> ObjectStoreError | None:
    """A clear error for a missing or forbidden bucket (None for any other failure)."""
    code, status = error_code(err)
    proto = SCHEMES.get(protocol_of(url), "s3")
    bucket = bucket_of(url)
    creds = CREDENTIALS_HELP[proto]
    # by the service's error code (GCS gives none but its message), never by the words of
    # the error's text, which names the object too (s3://my-bucket/a.jpg, a missing object)
    if code in ("NoSuchBucket", "ContainerNotFound") or "specified bucket does not exist" in (
        code.lower()
    ):
        return ObjectStoreError(
            f"cannot {what} {redact(url)}: the bucket {bucket} does not exist (or is not visible "
            f"to these credentials); check the bucket's name and region, and for a server other "
            f"than the provider's the endpoint ({creds})",
            bucket,
        )
    if (
        isinstance(err, PermissionError)
        or status in (401, 403)
        or code
        in (
            "AccessDenied",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "AuthorizationPermissionMismatch",
        )
    ):
        return ObjectStoreError(
            f"cannot {what} {redact(url)}: access to the bucket {bucket} was denied "
            f"({describe(err)}); check the credentials this process gets ({creds}) and that "
            f"they may list and read the bucket (s3:ListBucket and s3:GetObject on AWS, "
            f"storage.objects.list and .get on GCS)",
            bucket,
        )
    if type(err).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return ObjectStoreError(
            f"cannot {what} {redact(url)}: no credentials were found ({describe(err)}); "
            f"provide them through {creds}",
            bucket,
        )
    return None


def tag_of(info: Mapping[str, Any]) -> str:
    """What changes when an object is rewritten: GCS' generation, else the ETag, else mtime."""
    for k in ("generation", "ETag", "etag", "md5Hash", "content_md5", "mtime", "LastModified"):
        v = info.get(k)
        if v not in (None, ""):
            return f"{k}={v}"
    return ""


def _tag_hash(tag: str) -> int:
    return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Listed:
    """How a listing was made: ``where``, what was listed (a prefix, a pattern, "N URLs");
    ``fs``, the client that listed it (its session and connections are reused); ``relist``,
    the same listing made again (for the check that nothing changed during a fetch)."""

    where: str = ""
    fs: Any = None
    relist: Callable[[], Listing | None] | None = None


class Listing(OnAccess[str]):
    """The objects a build fetches, in build order: URLs (packed), sizes, ETag hashes.

    ``sizes[i] == -1`` for an object named by a list that does not exist (``missing``). About
    25 bytes an object plus its name: no dict or object per object is kept."""

    def __init__(
        self,
        protocol: str,
        urls: PathList,
        sizes: np.ndarray,
        tags: np.ndarray,
        missing: dict[int, str] | None = None,
        listed: Listed = Listed(),
    ) -> None:
        self.protocol, self.urls, self.sizes, self.tags = protocol, urls, sizes, tags
        self.missing = missing or {}
        self.listed = listed
        self.fs, self.where = listed.fs, listed.where

    def __len__(self) -> int:
        return len(self.urls)

    def item(self, i: int) -> str:
        return self.urls[i]

    def path(self, i: int) -> str:
        return strip(self.urls[i])

    def fingerprint(self, h: hashlib.blake2b) -> None:
        """Feed every object's URL, size and ETag hash to the hash ``h`` (the node key)."""
        for s in range(0, len(self), 4096):
            part = range(s, min(len(self), s + 4096))
            h.update("\n".join(self.urls[i] for i in part).encode("utf-8", "surrogateescape"))
            h.update(self.sizes[part.start : part.stop].tobytes())
            h.update(self.tags[part.start : part.stop].tobytes())

    def relist(self) -> Listing | None:
        again = self.listed.relist
        return None if again is None else again()

    def take(self, keep: np.ndarray) -> Listing:
        """The objects at ``keep`` (a node's share); listed again, the same positions of the new
        listing (all of it if its length changed, which the change check then reports)."""
        missing = {}  # the few objects a list named that do not exist, at their new positions
        if self.missing:
            lost = np.fromiter(self.missing, dtype=np.int64, count=len(self.missing))
            for k in np.flatnonzero(np.isin(keep, lost)).tolist():
                missing[k] = self.missing[int(keep[k])]

        def relist() -> Listing | None:
            again = self.relist()
            return again if again is None or len(again) != len(self) else again.take(keep)

        return Listing(
            self.protocol,
            self.urls.take(keep),
            self.sizes[keep],
            self.tags[keep],
            missing,
            dataclasses.replace(self.listed, relist=relist),
        )

    def __repr__(self) -> str:
        return f"<{len(self)} objects of {self.where}>"
