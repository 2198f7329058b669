"""`engine proxy`: one OpenAI endpoint in front of disaggregated prefill and decode replicas (xPyD).

Each completion goes to the next decode replica in turn, with `kv_transfer_params` naming the next prefill
replica in turn; the decode replica pulls the prompt's KV from it (`engine.server.disaggregation`) and streams
the answer, which the proxy passes through byte for byte (its status, headers and error objects too). A client
that goes away closes the proxy's stream to the decode replica, which aborts the request there.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx2
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from engine.core.errors import ConfigError
from engine.server.protocol import error_body

PASSED_HEADERS = ("authorization", "x-request-id", "content-type")
UPSTREAM_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        for name, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            if not urls:
                raise ConfigError(f"the proxy needs at least one {name} replica (--{name} URL)")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"--{name} {url!r} is not an http(s):// URL")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port!r}")


def build_proxy(config: ProxyConfig) -> FastAPI:
    prefills = itertools.cycle(config.prefill_urls)
    decodes = itertools.cycle(config.decode_urls)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx2.AsyncClient(timeout=UPSTREAM_TIMEOUT_S) as client:
            app.state.client = client
            yield

    app = FastAPI(title="kvplan disaggregated proxy", lifespan=lifespan)

    async def forward(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            return JSONResponse(error_body(f"the body is not JSON: {error}", "invalid_request_error"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the body must be a JSON object", "invalid_request_error"), 400)
        body["kv_transfer_params"] = {"prefill_url": next(prefills)}
        decode = next(decodes)
        headers = {name: request.headers[name] for name in PASSED_HEADERS if name in request.headers}
        client: httpx2.AsyncClient = request.app.state.client
        upstream = client.build_request("POST", f"{decode.rstrip('/')}{path}", json=body, headers=headers)
        try:
            response = await client.send(upstream, stream=True)
        except httpx2.HTTPError as error:
            return JSONResponse(error_body(f"the decode replica {decode} could not be reached: {error}",
                                           "server_error"), 502)
        passed = {name: value for name, value in response.headers.items()
                  if name.lower() in ("content-type", "x-request-id", "retry-after")}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=response.status_code, headers=passed)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        response = await request.app.state.client.get(f"{config.decode_urls[0].rstrip('/')}/v1/models",
                                                      headers={name: request.headers[name] for name in PASSED_HEADERS
                                                               if name in request.headers})
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 when every replica answers its /health with 200; else 503 naming the first that does not."""
        for url in config.prefill_urls + config.decode_urls:
            try:
                status = (await request.app.state.client.get(f"{url.rstrip('/')}/health", timeout=5.0)).status_code
            except httpx2.HTTPError:
                status = None
            if status != 200:
                return JSONResponse({"status": "unavailable", "replica": url, "replica_status": status}, 503)
        return JSONResponse({"status": "ok", "prefill": len(config.prefill_urls), "decode": len(config.decode_urls)})

    return app


def run_proxy(config: ProxyConfig) -> None:
    uvicorn.run(build_proxy(config), host=config.host, port=config.port, log_level="warning")
