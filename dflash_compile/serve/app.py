"""The HTTP routes (Starlette): OpenAI's completions and chat completions, models, health and metrics.

A generation request is checked and submitted in its handler (an error is OpenAI's error JSON with a 4xx status,
and no model work); its response then waits for the tokens without blocking the event loop, and watches the
connection meanwhile: a client that disconnects cancels its request, whose KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .engine import Engine, Generation
from .protocol import APIError, ParsedRequest, Reply, parse_body, parse_request, sse, usage


def create_app(engine: Engine, *, api_key: str | None = None) -> Starlette:
    """The ASGI app serving ``engine`` (run it with uvicorn). ``api_key``: the ``/v1`` routes then need
    ``Authorization: Bearer <api_key>``; ``/health`` and ``/metrics`` never do."""
    created = int(time.time())
    authorize = _authorizer(api_key)

    async def generate(request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            authorize(request)
            parsed = parse_request(parse_body(await request.body()), chat)
            engine.check_model(parsed.model)
            generation = engine.start(parsed, arrival)
        except APIError as e:
            engine.metrics.rejected(e.status)
            return error_response(e)
        return _GenerationResponse(generation, parsed, Reply(chat, engine.model_name))

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except APIError as e:
            return error_response(e)
        card = {"id": engine.model_name, "object": "model", "created": created, "owned_by": "dflash_compile",
                "max_model_len": engine.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.exposition(), media_type=engine.metrics.content_type)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.cancel_all()  # requests still in flight when the server stops leave the batch

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_error, Exception: _server_error})


def _authorizer(api_key: str | None):
    """A check that a request carries ``Authorization: Bearer <api_key>`` (none without a key)."""

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    return authorize


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                   headers=dict(exc.headers or {})))


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _GenerationResponse(Response):
    """Sends one generation, whole (JSON) or streamed (server-sent events, OpenAI's chunks, ``data: [DONE]``), and
    cancels it when the client disconnects first."""

    def __init__(self, generation: Generation, request: ParsedRequest, reply: Reply):
        super().__init__()
        self.generation, self.request, self.reply = generation, request, reply

    async def __call__(self, scope, receive, send) -> None:
        work = self._stream(send) if self.request.stream else self._whole(send)
        try:
            await _unless_disconnected(receive, work)
        finally:
            self.generation.close()  # cancels it unless it finished

    def _usage(self) -> dict:
        return usage(len(self.generation.prompt), self.generation.num_tokens)

    async def _whole(self, send) -> None:
        text, reason = [], None
        try:
            async for delta, reason in self.generation.deltas():
                text.append(delta)
        except Exception as e:  # the request failed in the model
            await _send_json(send, APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
            return
        if reason is None:  # cancelled: the server is stopping
            await _send_json(send, APIError(503, "the server is shutting down", type="server_error"))
            return
        body = self.reply.completion("".join(text), reason, self._usage())
        await _send_json(send, body)

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        async def event(data) -> None:
            await send({"type": "http.response.body", "body": sse(data), "more_body": True})

        reason = None
        try:
            async for delta, reason in self.generation.deltas():
                await event(self.reply.chunk(delta, reason))
        except OSError:  # the client is gone (the server's send failed)
            raise
        except Exception as e:  # the request failed in the model: an error event ends the stream
            await event(APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error").body())
        if reason is not None and self.request.include_usage:
            await event(self.reply.usage_chunk(self._usage()))
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_json(send, body: dict | APIError) -> None:
    status, headers = 200, {}
    if isinstance(body, APIError):
        status, headers, body = body.status, body.headers, body.body()
    response = JSONResponse(body, status_code=status, headers=headers)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


async def _unless_disconnected(receive, work) -> None:
    """Run ``work`` (sending the response) until it ends or the client disconnects, whichever comes first; a send
    that fails because the client left counts as a disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.done() and not task.cancelled() and isinstance(task.exception(), Exception) and not isinstance(
            task.exception(), OSError):
        raise task.exception()


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
