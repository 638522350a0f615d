"""The HTTP session under s3fs, told not to follow redirects.

s3fs runs aiobotocore, which sends its requests through aiohttp; aiohttp follows a redirect by
default, to any host and port, and aiobotocore leaves it so. A server (or anything on the way)
answering a GET with ``307 Location: http://elsewhere/...`` would have the object's bytes read
from elsewhere, and stored. botocore's own client (urllib3) never follows one: the 3xx answer
goes back to botocore, which raises it as the request's error (or, for S3's region redirects,
sends the request again to the endpoint it resolves for that region itself). ``SameEndpoint``
makes the async client do the same: aiobotocore's aiohttp session with
``allow_redirects=False`` on every request, handed to the client as ``AioConfig``'s
``http_session_cls`` (the client's configuration for its HTTP session) by
``_client.filesystem``; a redirected GET is then a final error of that object (``HTTP 307``,
with the address it pointed at), never bytes from another endpoint.
"""

from __future__ import annotations

from typing import Any

from aiobotocore.httpsession import AIOHTTPSession  # type: ignore[import-untyped]

#: the aiobotocore release from which ``AioConfig`` takes ``http_session_cls`` (and the
#: session's ``_get_session`` hook below exists)
AIOBOTOCORE_FLOOR = "2.12.2"


class _NoRedirects:
    """An aiohttp ``ClientSession`` whose ``request`` never follows a redirect."""

    __slots__ = ("_session",)

    def __init__(self, session: Any) -> None:
        self._session = session

    def request(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["allow_redirects"] = False
        return self._session.request(*args, **kwargs)


class SameEndpoint(AIOHTTPSession):  # type: ignore[misc]
    """aiobotocore's aiohttp session, every request sent with ``allow_redirects=False``."""

    async def _get_session(self, proxy_url: Any) -> Any:
        return _NoRedirects(await super()._get_session(proxy_url))


def session_class() -> type[SameEndpoint]:
    """``SameEndpoint``, or ImportError naming the fix when this aiobotocore cannot take it."""
    import inspect

    import aiobotocore  # type: ignore[import-untyped]
    from aiobotocore.config import AioConfig  # type: ignore[import-untyped]

    if "http_session_cls" not in inspect.signature(AioConfig).parameters or not hasattr(
        AIOHTTPSession, "_get_session"
    ):
        raise ImportError(
            f"aiobotocore {getattr(aiobotocore, '__version__', '?')} cannot be told not to "
            "follow redirects, so an object's bytes could be read from another server than "
            f"the endpoint's; install a newer one: pip install 'aiobotocore>={AIOBOTOCORE_FLOOR}'"
        )
    return SameEndpoint
