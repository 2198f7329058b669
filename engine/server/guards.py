"""What stands before the handlers: the API key and the request body limit, as plain ASGI middleware.

Both answer before a handler runs and before the body is parsed: a stranger costs one header comparison, an
oversized body is cut off at the limit instead of being read whole. Keys are compared as SHA-256 digests with
`hmac.compare_digest`, so the time taken tells nothing of the key, not even its length.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

Refusal = Callable[[int, str, str, str | None, dict[str, str]], JSONResponse]   # status, message, type, code, headers
PROTECTED_PREFIXES = ("/v1/", "/debug/")    # the model's routes and fault injection; /health stays open


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class ApiKeyGuard:
    """`Authorization: Bearer KEY` on the model's routes (and on /metrics when it has a key of its own);
    a missing or wrong key gets OpenAI's 401."""

    def __init__(self, app: ASGIApp, refuse: Refusal, api_key: str | None, metrics_api_key: str | None) -> None:
        self.app = app
        self.refuse = refuse
        self.api_key = None if api_key is None else _digest(f"Bearer {api_key}".encode())
        self.metrics_api_key = None if metrics_api_key is None else _digest(f"Bearer {metrics_api_key}".encode())

    def _expected(self, path: str) -> bytes | None:
        if path == "/metrics":
            return self.metrics_api_key
        return self.api_key if path.startswith(PROTECTED_PREFIXES) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        expected = self._expected(scope.get("path", "")) if scope["type"] == "http" else None
        if expected is not None:
            given = _header(scope, b"authorization")
            if given is None:
                message = "no API key: send the header 'Authorization: Bearer <key>'"
            elif not hmac.compare_digest(_digest(given), expected):
                message = "incorrect API key"
            else:
                message = None
            if message is not None:
                await self.refuse(401, message, "invalid_request_error", "invalid_api_key",
                                  {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Request bodies of at most `max_bytes`: a larger declared Content-Length is refused at once, a chunked body
    as soon as it passes the limit (413 either way); the body read is handed on to the app unchanged."""

    def __init__(self, app: ASGIApp, refuse: Refusal, max_bytes: int) -> None:
        self.app = app
        self.refuse = refuse
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> JSONResponse:
        return self.refuse(413, f"the request body has {size} bytes; this server accepts at most {self.max_bytes} "
                                f"(--max-body-bytes)", "invalid_request_error", None, {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(declared.decode())(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":       # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(f"more than {self.max_bytes}")(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()          # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
