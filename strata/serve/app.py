"""The OpenAI-compatible HTTP app: parse, submit to the scheduler, answer (JSON or SSE).

The app never touches tensors: it tokenizes, submits token ids to a `Scheduler` (which owns the
model in its own thread) and relays `Response`s. A client that disconnects has its request
cancelled at once, which frees its batch slot before the next decode step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from strata.errors import StrataError
from strata.runtime.scheduler import InvalidRequest, PromptTooLong, QueueFull, Scheduler, SchedulerClosed
from strata.serve import metrics as prom
from strata.serve import protocol as p
from strata.serve.protocol import DEFAULT_MAX_BODY_BYTES, APIError

log = logging.getLogger(__name__)
RETRY_AFTER_S = "1"


def create_app(engine, model_name: str, api_key: str | None = None, max_concurrent: int = 8,
               max_waiting: int | None = None, *, scheduler: Scheduler | None = None,
               metrics_sources: list[prom.MetricsSource] = (),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An app serving `engine` as `model_name`; `api_key` (when set) is required on /v1/*.

    `max_concurrent` requests decode together and `max_waiting` more may queue (default
    4 x max_concurrent); past that requests get 429. A body over `max_body_bytes` gets 413.
    The scheduler is `app.state.scheduler`.
    """
    if engine.tokenizer is None:
        raise StrataError("the model has no tokenizer, so it cannot be served",
                          "use a GGUF with tokenizer metadata or a directory with tokenizer.json")
    sched = scheduler or Scheduler(engine, max_concurrent, max_waiting)
    tokenizer = engine.tokenizer
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await run_in_threadpool(sched.close, False, 10.0)

    app = FastAPI(title="strata", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = sched
    app.state.engine = engine
    app.state.model_name = model_name

    # -- errors in OpenAI's shape ------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(p.error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(p.error_body(f"internal server error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            raise APIError(401, "You didn't provide an API key. Pass it as 'Authorization: Bearer KEY'.",
                           "invalid_request_error", None, "missing_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    # -- plain endpoints -----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if sched.closing:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        reason = getattr(getattr(engine, "tiers", None), "unavailable", None)
        if reason:  # an expert-parallel rank died or went silent
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok", "model": model_name}

    @app.get("/metrics")
    async def metrics():
        sources = [lambda: prom.scheduler_metrics(sched.stats(), model_name), lambda: prom.engine_metrics(engine),
                   *metrics_sources]
        out = []
        for source in sources:
            try:
                out.extend(source())
            except Exception:  # one broken source must not hide the others
                log.exception("metrics source failed")
        return PlainTextResponse(prom.render(out), media_type=prom.CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "strata",
                "context_length": engine.ctx_size}

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        authorize(request)
        if name != model_name:
            raise _unknown_model(name)
        return model_card()

    # -- generation ------------------------------------------------------------------------------------

    async def start(request: Request, parse, param: str):
        """Parse, check and submit; returns (the parsed request, the scheduler's handle)."""
        authorize(request)
        body = await _json_body(request, max_body_bytes)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise p.bad("you must provide a model parameter", "model")
        if model != model_name:
            raise _unknown_model(model)
        gen = await run_in_threadpool(parse, body, tokenizer)
        p.check_prompt(gen.prompt_ids, engine.ctx_size, engine.config.vocab_size, param)
        room = engine.ctx_size - len(gen.prompt_ids)
        max_tokens = room if gen.max_tokens is None else min(gen.max_tokens, room)
        try:
            handle = sched.submit(gen.prompt_ids, max_tokens, gen.params, gen.stop)
        except QueueFull as e:
            raise APIError(429, f"The server is busy: {e}.", "rate_limit_exceeded", None, "rate_limit_exceeded",
                           {"Retry-After": RETRY_AFTER_S}) from None
        except SchedulerClosed as e:
            raise _unavailable(e) from None
        except PromptTooLong as e:
            raise p.bad(str(e), param, "context_length_exceeded") from None
        except InvalidRequest as e:
            raise p.bad(str(e), param) from None
        return gen, handle

    async def endpoint(request: Request, parse, param: str, prefix: str, events, respond):
        """The shape both endpoints share: parse, submit, then stream events or one response."""
        gen, handle = await start(request, parse, param)
        rid = p.new_id(prefix)
        if gen.stream:
            return _EventStream(events(handle, gen, rid, model_name), handle)
        text = await _collect(request, handle)
        if text is None:
            return Response(status_code=499)
        return respond(rid, model_name, text, handle.finish_reason, handle.prompt_tokens, handle.completion_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await endpoint(request, p.parse_chat, "messages", "chatcmpl", _chat_events, p.chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await endpoint(request, p.parse_completion, "prompt", "cmpl", _completion_events,
                              p.completion_response)

    return app


def _unknown_model(name: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist.", "invalid_request_error", "model", "model_not_found")


def _unavailable(e: Exception) -> APIError:
    return APIError(503, f"The server is shutting down: {e}.", "server_error", None, "service_unavailable",
                    {"Retry-After": RETRY_AFTER_S})


async def _json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object; a body over `limit` bytes gets 413 before it is read in full."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # also bounds a chunked body, which declares no length
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise p.bad("We could not parse the JSON body of your request.") from None
    except RecursionError:
        raise p.bad("The JSON body of your request is nested too deeply.") from None
    if not isinstance(body, dict):
        raise p.bad("The request body must be a JSON object.")
    return body


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({size} bytes read, the limit is "
                    f"{limit}; the server's --max-body-bytes sets it).", "invalid_request_error", None,
                    "request_too_large")


def _engine_failure(e: BaseException) -> APIError:
    if isinstance(e, SchedulerClosed):
        return _unavailable(e)
    if getattr(e, "unavailable", False):  # e.g. an expert-parallel rank is gone: the job must restart
        return APIError(503, str(e), "server_error", None, "service_unavailable")
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error", None, None)


async def _collect(request: Request, handle) -> str | None:
    """The whole completion text, or None when the client went away first (then it is cancelled)."""

    async def text():
        return "".join([r.text async for r in handle])

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collect, disconnect = asyncio.ensure_future(text()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():
            handle.cancel()
            collect.cancel()
    if not collect.done() or collect.cancelled():
        return None
    if collect.exception() is not None:
        raise _engine_failure(collect.exception())
    return collect.result()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(handle, usage: bool, chunks, usage_chunk):
    """The SSE frame shared by both endpoints: the format's chunks, the usage chunk when asked,
    `[DONE]`; an engine failure becomes an error event, and the request ends with the stream."""
    try:
        async for chunk in chunks:
            yield _sse(chunk)
        if usage:
            yield _sse(usage_chunk(handle.prompt_tokens, handle.completion_tokens))
        yield "data: [DONE]\n\n"
    except Exception as e:
        yield _sse(_engine_failure(e).body())
    finally:
        handle.cancel()


def _chat_events(handle, gen, rid: str, model: str):
    created, usage = int(time.time()), gen.include_usage

    async def chunks():
        yield p.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, with_usage=usage)
        async for r in handle:
            if r.text:
                yield p.chat_chunk(rid, model, created, {"content": r.text}, with_usage=usage)
            if r.finish_reason is not None:
                yield p.chat_chunk(rid, model, created, {}, r.finish_reason, with_usage=usage)

    return _events(handle, usage, chunks(),
                   lambda n_prompt, n_out: p.usage_chunk(rid, model, created, "chat.completion.chunk", n_prompt, n_out))


def _completion_events(handle, gen, rid: str, model: str):
    created, usage = int(time.time()), gen.include_usage

    async def chunks():
        async for r in handle:
            if r.text or r.finish_reason is not None:
                yield p.completion_chunk(rid, model, created, r.text, r.finish_reason, with_usage=usage)

    return _events(handle, usage, chunks(),
                   lambda n_prompt, n_out: p.usage_chunk(rid, model, created, "text_completion", n_prompt, n_out))


class _EventStream(StreamingResponse):
    """SSE that watches for the client leaving whatever the ASGI server's spec version, and
    cancels the request the moment it does (Starlette relies on a failed send for ASGI >= 2.4,
    which would only notice at the next token)."""

    def __init__(self, content, handle):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the connection broke mid-send
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.handle.cancel()
