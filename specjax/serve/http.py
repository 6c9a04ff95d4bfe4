"""The OpenAI-compatible HTTP server over the scheduler (FastAPI + uvicorn, SSE for streaming).

Endpoints: POST /v1/completions and /v1/chat/completions (streamed or not), GET /v1/models,
/health (liveness: 200 as soon as the process listens, saying whether it is ready), /ready (200 once
every program is compiled, 503 before) and /metrics (Prometheus text). While the server starts,
requests get 503 with Retry-After. A request may carry a long `document`: it goes before the
prompt (or the last user message), and a rapid or rapid+block server drafts from the chunks of it
retrieved for the question (the `retrieval` object overrides the server's retrieval settings). Each response carries its request's speculative metrics
under `metrics.speculative_decoding`, as vLLM's do. Bad input gets 400 with a message, a full queue
429 with Retry-After, and a client that disconnects cancels its request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from specjax.data.retrieval import RetrievalConfig

from specjax.errors import SpecjaxError
from specjax.serve.scheduler import QueueFull, Request, RequestHandle, RequestResult, Scheduler


log = logging.getLogger(__name__)


class BadRequest(SpecjaxError):
    pass


class Startup:
    """A server's scheduler, built on a thread so that the process answers /health while it loads
    the model and compiles (minutes on a cold 2-core start): liveness apart from readiness."""

    def __init__(self, build: Callable[[], Scheduler], model_name: str, context_length: int,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.model_name = model_name
        self.context_length = context_length
        self.scheduler: Scheduler | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self._build = build
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="specjax-startup", daemon=True)

    @classmethod
    def of(cls, scheduler: Scheduler) -> "Startup":
        """An already built (and compiled) scheduler: ready from the start."""
        startup = cls(lambda: scheduler, scheduler.model.name, scheduler.config.context_length)
        startup.scheduler = scheduler
        return startup

    def start(self) -> "Startup":
        if self.scheduler is None:
            self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> Scheduler | None:
        if self._thread.is_alive():
            self._thread.join(timeout)
        return self.scheduler

    def _run(self) -> None:
        try:
            self.scheduler = self._build()
        except BaseException as exc:  # noqa: BLE001 - reported by /health and to the process
            self.error = exc
            log.exception("the server failed to start")
            if self._on_failure is not None:
                self._on_failure(exc)

    @property
    def phase(self) -> str:
        return "failed" if self.error is not None else "ready" if self.scheduler is not None else "starting"


def _number(body: dict, name: str, kind, default, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    value = kind(value)
    if low is not None and value < low or high is not None and value > high:
        raise BadRequest(f"'{name}' must be in [{low}, {high}], got {value}")
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}")


# What a request may change of the server's retrieval settings. The chunking stays the server's:
# a document's index is built once per chunk size and shared by every request about it.
_RETRIEVAL_FIELDS = {"retriever": None, "budget_tokens": int, "top_k": int, "min_score": float}


def _retrieval_config(scheduler: Scheduler, body: dict) -> RetrievalConfig:
    overrides = body.get("retrieval")
    if overrides is None:
        return scheduler.config.retrieval
    if not isinstance(overrides, dict):
        raise BadRequest(f"'retrieval' must be an object with some of {', '.join(_RETRIEVAL_FIELDS)}")
    unknown = sorted(set(overrides) - set(_RETRIEVAL_FIELDS))
    if unknown:
        raise BadRequest(f"unknown retrieval setting {unknown[0]!r}; a request may set {', '.join(_RETRIEVAL_FIELDS)}")
    values = {}
    for name, kind in _RETRIEVAL_FIELDS.items():
        if name not in overrides:
            continue
        if kind is None:
            if not isinstance(overrides[name], str):
                raise BadRequest(f"'retrieval.{name}' must be a string, got {overrides[name]!r}")
            values[name] = overrides[name]
        else:
            values[name] = _number(overrides, name, kind, None, 1 if kind is int else None, None)
    try:
        return dataclasses.replace(scheduler.config.retrieval, **values)
    except SpecjaxError as exc:
        raise BadRequest(f"bad retrieval settings: {exc}") from None


# OpenAI's "developer" messages are the newer name for "system" ones.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_CHOICES = 16
"""Most choices one request may ask for (n times the prompts of a batched completion)."""


def body_limit(context_length: int) -> int:
    """Most bytes a request body may hold: 64 per context position (a token is rarely over 16 bytes
    of text, and JSON escaping can quadruple that), at least 1 MiB. Checked before any tokenizing, so
    a huge body costs the server nothing."""
    return max(1 << 20, 64 * context_length)


def _messages(body: dict) -> list[dict]:
    """'messages' as {role, content} with string content: text parts ([{"type": "text", "text": ...}],
    as many clients send) joined by newlines; roles checked."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}")
        if isinstance(content, list):
            kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
            if kinds - {"text"}:
                raise BadRequest(f"messages[{i}].content: only text parts are supported, got "
                                 f"{', '.join(sorted(map(str, kinds - {'text'})))}")
            if not all(isinstance(part.get("text"), str) for part in content):
                raise BadRequest(f"messages[{i}].content: every text part needs a string 'text'")
            content = "\n".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts, got {content!r:.60}")
        out.append({"role": _ROLES[role], "content": content})
    return out


def _parse_request(scheduler: Scheduler, body: Any, chat: bool) -> tuple[list[Request], bool, dict | None]:
    """An OpenAI request body -> (one Request per choice, stream, what retrieval did for a document
    request or None); raises BadRequest with a message for the client. A batched completion (a list
    of prompt strings) and n > 1 give several choices, prompt-major as OpenAI orders them. A
    document is tokenized, indexed (or found in the index cache) and searched here, so call it off
    the event loop."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != scheduler.model.name:
        raise BadRequest(f"unknown model {model!r}; this server serves {scheduler.model.name!r}")
    tokenizer = scheduler.model.tokenizer
    document = body.get("document")
    if document is not None and (not isinstance(document, str) or not document.strip()):
        raise BadRequest("'document' must be a non-empty string")
    if document is None and body.get("retrieval") is not None:
        raise BadRequest("'retrieval' applies to a request with a 'document'")
    if document is not None and tokenizer is None:
        raise BadRequest("this model has no tokenizer, which a document request needs")
    for name in ("logprobs", "top_logprobs"):
        if body.get(name) not in (None, False, 0):
            raise BadRequest(f"'{name}' is not supported by this server")
    n = _number(body, "n", int, 1, 1, MAX_CHOICES)
    if chat:
        messages = _messages(body)
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer; use /v1/completions with token ids")
        prompts = [tokenizer.encode_chat(messages)]
    else:
        raw = body.get("prompt")
        if document is not None and not isinstance(raw, str):
            raise BadRequest("with a document, give the prompt (the question) as a string")
        prompts = _completion_prompts(raw, tokenizer, n)
    if not all(prompts):
        raise BadRequest("the prompt is empty")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    if stream and len(prompts) * n > 1:
        raise BadRequest("streaming returns one choice: use n=1 and one prompt, or stream=false")
    fields = _request_fields(body, chat, scheduler.config.max_new_tokens)
    retrieval = None
    try:
        if document is None:
            requests = [Request(prompt=tuple(prompt), **fields) for prompt in prompts]
        else:
            request, retrieval = scheduler.document_request(
                document, messages if chat else raw, _retrieval_config(scheduler, body), chat=chat, **fields)
            requests = [request]
        for request in requests:
            scheduler.validate(request)
    except QueueFull:
        raise
    except SpecjaxError as error:
        raise BadRequest(str(error)) from None
    # n choices of each prompt; with a seed, choice j samples with seed + j (the same seed would
    # repeat the draw).
    return [dataclasses.replace(r, seed=None if r.seed is None else r.seed + j) for r in requests
            for j in range(n)], stream, retrieval


def _completion_prompts(raw, tokenizer, n: int) -> list[list[int]]:
    """/v1/completions' prompt: a string, a list of strings (a batch) or a list of token ids."""
    batch = raw if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw) else [raw]
    if len(batch) * n > MAX_CHOICES:
        raise BadRequest(f"{len(batch)} prompts x n={n} is {len(batch) * n} choices; at most {MAX_CHOICES}")
    prompts = []
    for one in batch:
        if isinstance(one, str):
            if tokenizer is None:
                raise BadRequest("this model has no tokenizer; give the prompt as a list of token ids")
            prompts.append(tokenizer.encode(one) if one else [])
        elif isinstance(one, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in one):
            prompts.append(list(one))
        else:
            raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids")
    return prompts


def _request_fields(body: dict, chat: bool, max_new_tokens: int) -> dict:
    """The sampling and stopping fields every choice of the body shares, checked."""
    # specjax's own fields: opt out of speculation, or ask for one of the server's policies.
    speculation = body.get("speculation", True)
    if not isinstance(speculation, bool):
        raise BadRequest(f"'speculation' must be true or false, got {speculation!r}")
    method = body.get("method")
    if method is not None and not isinstance(method, str):
        raise BadRequest(f"'method' must be a string, got {method!r}")
    fields = dict(
        max_tokens=_number(body, "max_tokens", int, 16 if not chat else 128, 1, max_new_tokens),
        temperature=_number(body, "temperature", float, 1.0, 0.0, 100.0),
        top_k=max(0, _number(body, "top_k", int, 0, -1, None)),  # OpenAI clients send -1 for "off"
        top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
        seed=_number(body, "seed", int, None, 0, 2**63 - 1),
        stop=_stop_strings(body),
        speculation=speculation,
        method=method,
    )
    if fields["top_p"] == 0.0:
        raise BadRequest("'top_p' must be above 0")
    return fields


def _usage(result: RequestResult) -> dict:
    prompt = result.metrics.get("prompt_tokens", 0)
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(server: Scheduler | Startup):
    """A FastAPI app serving a scheduler, or one still being built (a Startup)."""
    startup = server if isinstance(server, Startup) else Startup.of(server)
    app = FastAPI(title="specjax", version="0.1")

    @app.get("/health")
    def health():
        scheduler = startup.scheduler
        body = {"status": "failed" if startup.error is not None else "ok", "ready": scheduler is not None,
                "phase": startup.phase}
        if scheduler is not None:
            body.update(running=scheduler.num_running, waiting=scheduler.num_waiting)
        return JSONResponse(body, status_code=500 if startup.error is not None else 200)

    @app.get("/ready")
    def ready():
        if startup.scheduler is None:
            return _not_ready(startup)
        return {"status": "ready"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": startup.model_name, "object": "model", "created": 0,
                                            "owned_by": "specjax", "max_model_len": startup.context_length}]}

    @app.get("/metrics")
    def metrics():
        if startup.scheduler is None:
            return _not_ready(startup)
        return PlainTextResponse(startup.scheduler.metrics.prometheus_text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await _complete(startup, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await _complete(startup, http, chat=True)

    return app


def _error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    """An error body as OpenAI's API shapes it."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def _not_ready(startup: Startup) -> JSONResponse:
    if startup.error is not None:
        return _error(500, f"the server failed to start: {startup.error}", "server_error")
    return _error(503, f"the server is starting (loading and compiling, {time.monotonic() - startup.started:.0f} s "
                       "so far); GET /ready answers 200 once it serves", "service_unavailable",
                  headers={"Retry-After": "5"})


async def _read_json_body(http: HttpRequest, config):
    """(the parsed body, None), or (None, an error response): a body over the byte limit (the
    ServeConfig's max_request_bytes, or `body_limit`) is refused by its declared length before it is
    read, and by its length once read."""
    limit = config.max_request_bytes or body_limit(config.context_length)
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None, _error(413, f"the request body has {int(declared):,} bytes; this server reads at most {limit:,} "
                                 f"(--max-request-bytes)")
    raw = await http.body()
    if len(raw) > limit:
        return None, _error(413, f"the request body has {len(raw):,} bytes; this server reads at most {limit:,}")
    try:
        return json.loads(raw), None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, _error(400, f"the request body is not valid JSON: {exc}")


async def _complete(startup: Startup, http: HttpRequest, chat: bool):
    """A completion or chat completion: parse, submit every choice, then stream or answer whole."""
    scheduler = startup.scheduler
    if scheduler is None:
        return _not_ready(startup)
    body, refused = await _read_json_body(http, scheduler.config)
    if refused is not None:
        return refused
    handles = []
    try:
        requests, stream, retrieval = await run_in_threadpool(_parse_request, scheduler, body, chat)
        for request in requests:
            handles.append(scheduler.submit(request))
    except (QueueFull, SpecjaxError) as exc:
        for handle in handles:  # the choices already queued go too: the body is answered as a whole
            handle.cancel()
        if isinstance(exc, QueueFull):
            return _error(429, str(exc), "rate_limit_error", headers={"Retry-After": "1"})
        return _error(400, str(exc))
    created = int(time.time())
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if stream:
        return StreamingResponse(_sse(http, handles[0], request_id, created, startup.model_name, chat, retrieval),
                                 media_type="text/event-stream")
    try:
        results = [await _wait_or_cancel(http, handle, handles) for handle in handles]
    except _Disconnected:
        return _error(499, "client disconnected")
    failed = [r for r in results if r.finish_reason == "error"]
    if failed:
        return _error(500, failed[0].error or "decoding failed", "server_error")
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": startup.model_name, "choices": _choices(results, chat, retrieval),
            "usage": _total_usage(results, per_prompt=body.get("n") or 1),  # n validated by _parse_request
            "metrics": _with_retrieval(results[0].metrics, retrieval)}


def _choices(results: list, chat: bool, retrieval) -> list[dict]:
    choices = []
    for index, result in enumerate(results):
        choice = {"index": index, "finish_reason": _finish_reason(result), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
            choice["token_ids"] = result.token_ids
        if len(results) > 1:
            choice["metrics"] = _with_retrieval(result.metrics, retrieval)
        choices.append(choice)
    return choices


def _total_usage(results: list, per_prompt: int) -> dict:
    """Token counts over every choice; choices come per_prompt (n) to a prompt, and each prompt is
    counted once, as OpenAI does."""
    usage = [_usage(r) for r in results]
    prompt_tokens = sum(u["prompt_tokens"] for u in usage[::per_prompt])
    completion_tokens = sum(u["completion_tokens"] for u in usage)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Disconnected(Exception):
    pass


async def _wait_or_cancel(http, handle: RequestHandle, siblings: list[RequestHandle] = ()) -> RequestResult:
    """The request's result; if the client goes away first, cancel it and its siblings (the other
    choices of the same body), freeing their slots."""
    import asyncio

    waiter = asyncio.ensure_future(handle.wait())
    while True:
        done, _ = await asyncio.wait({waiter}, timeout=0.25)
        if done:
            return waiter.result()
        if await http.is_disconnected():
            for other in (handle, *siblings):
                other.cancel()
            raise _Disconnected()


def _with_retrieval(metrics: dict, retrieval: dict | None) -> dict:
    """The request's metrics, with what retrieval did for a document request."""
    return metrics if retrieval is None else {**metrics, "retrieval": retrieval}


def _finish_reason(result: RequestResult) -> str:
    return {"cancelled": "abort"}.get(result.finish_reason, result.finish_reason)


async def _sse(http, handle: RequestHandle, request_id: str, created: int, model: str, chat: bool,
               retrieval: dict | None = None):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def chunk(delta_text: str, token_ids: list[int], finish: str | None, extra: dict | None = None) -> str:
        choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = {"content": delta_text} if (delta_text or finish is None) else {}
        else:
            choice["text"] = delta_text
            choice["token_ids"] = token_ids
        return event({"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice],
                      **(extra or {})})

    try:
        if chat:
            yield event({"id": request_id, "object": kind, "created": created, "model": model,
                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]})
        async for piece in handle.stream():
            if await http.is_disconnected():
                handle.cancel()
                return
            yield chunk(piece.text, piece.token_ids, None)
        result = await handle.wait()
        if result.finish_reason == "error":
            yield event({"error": {"message": result.error or "decoding failed", "type": "server_error", "code": 500}})
        else:
            yield chunk("", [], _finish_reason(result), {"usage": _usage(result),
                                                         "metrics": _with_retrieval(result.metrics, retrieval)})
        yield "data: [DONE]\n\n"
    finally:
        if not handle.done:  # the response was abandoned (client gone): free the slot
            handle.cancel()
