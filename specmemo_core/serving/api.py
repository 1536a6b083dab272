"""The HTTP routes of ``specmemo serve``: OpenAI's ``/v1/models`` (and ``/v1/models/{id}``),
``/v1/chat/completions`` and ``/v1/completions`` on Starlette.

The event loop only reads requests and writes replies: prompts are tokenized in a worker
thread and decoded on the scheduler's thread, whose events come back through
``EventInbox`` (``loop.call_soon_threadsafe``). A client that disconnects cancels its
ticket, which frees its sequence before the next step. Every refusal is OpenAI's error
JSON with a 4xx status; request text is logged only with ``log_text``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specmemo_core.errors import InvalidApiKeyError, RequestError, RequestTooLargeError, SpecMemoError
from specmemo_core.serving import openai_format as fmt
from specmemo_core.serving.scheduler import Delta, Event, Failed, Finished, Job, Ticket
from specmemo_core.serving.served import ServedModel

log = logging.getLogger("specmemo.serve")
MAX_BODY_BYTES = 8 * 2**20  # a 131k-token prompt is well under this
DISCONNECT_POLL_S = 0.5  # how often a request that does not stream checks its client is still there


@dataclass(frozen=True)
class ApiOptions:
    api_key: str | None = None  # None: any key (or none) is accepted
    log_text: bool = False  # log prompts and replies (off: only sizes and speeds)


class EventInbox:
    """One request's events, put by the scheduler's thread, awaited on the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def deliver(self, event: Event) -> None:  # the scheduler's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self) -> Event:
        return await self.queue.get()


def error_response(error: Exception) -> JSONResponse:
    status = error.status if isinstance(error, RequestError) else 500
    return JSONResponse(fmt.error_json(error), status_code=status)


async def read_json(request: Request) -> object:
    """The body as JSON, at most ``MAX_BODY_BYTES`` read."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise RequestTooLargeError(f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB",
                                       code="request_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})", code="invalid_json") from exc


class Routes:
    """The handlers over one ``ServedModel``."""

    def __init__(self, served: ServedModel, options: ApiOptions) -> None:
        self.served = served
        self.options = options

    def check_key(self, request: Request) -> None:
        if self.options.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.options.api_key.encode()):
            raise InvalidApiKeyError("the API key is missing or wrong: send the key the server was started "
                                     "with as `Authorization: Bearer KEY`", code="invalid_api_key")

    def _card(self) -> dict:
        return {"id": self.served.name, "object": "model", "created": 0, "owned_by": "specmemo"}

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        self.check_key(request)
        self.served.check_model(request.path_params["model"])
        return JSONResponse(self._card())

    async def chat(self, request: Request) -> Response:
        self.check_key(request)
        parsed = fmt.read_chat(await read_json(request))
        return await self._reply(request, parsed.sampling, lambda: self.served.chat_job(parsed), chat=True)

    async def completions(self, request: Request) -> Response:
        self.check_key(request)
        parsed = fmt.read_completion(await read_json(request))
        return await self._reply(request, parsed.sampling, lambda: self.served.completion_job(parsed), chat=False)

    async def _reply(self, request: Request, sampling: fmt.Sampling, make_job: Callable[[], Job], *,
                     chat: bool) -> Response:
        job = await run_in_threadpool(make_job)  # tokenizing a long prompt would stall every stream
        inbox = EventInbox()
        ticket = self.served.scheduler.submit(job, inbox.deliver)
        header = fmt.ReplyHeader.new(self.served.name, chat)
        self._log_start(ticket, request)
        if sampling.stream:
            return StreamingResponse(self._stream(ticket, inbox, header, sampling.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(request, ticket, inbox, header)

    async def _whole(self, request: Request, ticket: Ticket, inbox: EventInbox,
                     header: fmt.ReplyHeader) -> Response:
        text = []
        try:
            while True:
                event = await _next_or_gone(inbox, request.is_disconnected)
                if event is None:
                    return Response(status_code=499)  # nobody reads it: the ticket is cancelled below
                if isinstance(event, Delta):
                    text.append(event.text)
                elif isinstance(event, Finished):
                    self._log_end(ticket, event, "".join(text))
                    return JSONResponse(fmt.reply_json(header, "".join(text), event, self.served.tree))
                else:
                    return error_response(event.error)
        finally:
            ticket.cancel()  # a no-op once finished

    async def _stream(self, ticket: Ticket, inbox: EventInbox, header: fmt.ReplyHeader,
                      include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a role chunk, text chunks, the finish chunk, the usage chunk
        (if asked), ``[DONE]``. Starlette cancels this generator when the client leaves."""
        text = []
        try:
            yield _sse(_with_usage(fmt.chunk_json(header, "", role=True), include_usage))
            while True:
                event = await inbox.next()
                if isinstance(event, Delta):
                    if event.text:
                        text.append(event.text)
                        yield _sse(_with_usage(fmt.chunk_json(header, event.text), include_usage))
                    continue
                if isinstance(event, Finished):
                    self._log_end(ticket, event, "".join(text))
                    end = fmt.chunk_json(header, None, reason=event.reason)
                    if not include_usage:
                        end["specmemo"] = fmt.specmemo_json(event, self.served.tree)
                    yield _sse(_with_usage(end, include_usage))
                    if include_usage:
                        yield _sse(fmt.usage_chunk_json(header, event, self.served.tree))
                else:
                    yield _sse(fmt.error_json(event.error))
                yield "data: [DONE]\n\n"
                return
        finally:
            ticket.cancel()  # a client that left frees its sequence; a no-op once finished

    def _log_start(self, ticket: Ticket, request: Request) -> None:
        log.info("request %d %s: %d prompt tokens, max %d", ticket.seq_id, request.url.path,
                 len(ticket.job.prompt_ids), ticket.job.config.max_new_tokens)
        if self.options.log_text:
            log.info("request %d prompt: %r", ticket.seq_id, self.served.tokenizer.decode(list(ticket.job.prompt_ids)))

    def _log_end(self, ticket: Ticket, finished: Finished, text: str) -> None:
        log.info("request %d done (%s): %d tokens, %.1f tok/s, %.2f tokens/step", ticket.seq_id, finished.reason,
                 finished.usage.completion_tokens, finished.stats.tokens_per_s, finished.stats.mean_accepted)
        if self.options.log_text:
            log.info("request %d reply: %r", ticket.seq_id, text)


async def _next_or_gone(inbox: EventInbox, gone: Callable[[], Awaitable[bool]]) -> Event | None:
    """The next event, or None once the client has disconnected (no event is lost: a
    cancelled ``Queue.get`` takes nothing)."""
    getter = asyncio.ensure_future(inbox.queue.get())
    while True:
        done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
        if done:
            return getter.result()
        if await gone():
            getter.cancel()
            return None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _with_usage(chunk: dict, include_usage: bool) -> dict:
    """With ``include_usage`` every chunk but the last carries ``"usage": null`` (as OpenAI's do)."""
    if include_usage:
        chunk["usage"] = None
    return chunk


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=exc.status_code)


async def _known_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error in %s", request.url.path)
    return error_response(SpecMemoError(f"unexpected {type(exc).__name__}: {exc}; please report it"))


def build_app(served: ServedModel, options: ApiOptions = ApiOptions()) -> Starlette:
    routes = Routes(served, options)
    return Starlette(
        routes=[Route("/v1/models", routes.models, methods=["GET"]),
                Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
                Route("/v1/chat/completions", routes.chat, methods=["POST"]),
                Route("/v1/completions", routes.completions, methods=["POST"])],
        exception_handlers={HTTPException: _http_error, SpecMemoError: _known_error, Exception: _unexpected},
    )
