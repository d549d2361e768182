"""The ASGI app (FastAPI): routes, request lifecycle, start-up and graceful shutdown.

    POST /predict   classification, TEI's API (serving/api.py)
    POST /rerank    (query, text) scores of a one-label classification folder, TEI's API
    POST /qa        question answering
    POST /tokens    token classification (NER): transformers' token-classification pipeline's answer
    POST /embed     sentence embeddings, TEI's API (a sentence-transformers folder)
    POST /v1/embeddings   the same, OpenAI's API
    GET  /health    200 while the worker thread is alive
    GET  /ready     200 while requests are admitted; 503 before start-up and from shutdown on
    GET  /metrics   Prometheus text (serving/metrics.py)
    GET  /info      the model, its labels, the policy and the limits

A request, from bytes to answer: the body is read up to the byte limit (413 beyond, from
Content-Length before reading; 408 if it has not arrived within the body timeout) →
parsed strictly (422 / 413 with one line) → tokenized in a thread pool, off the event loop
→ admitted to the scheduler's bounded queue (429 when full) → batched by the policy and run
on the worker thread → answered in input order, or 504 past its timeout; a client that
disconnects first is counted as 499 and its queued sequences leave the queue. Errors use TEI's
body, {"error": "...", "error_type": "..."}. Every request read counts once in
packed_requests_total under the status it got.

Shutdown (SIGTERM): uvicorn stops accepting connections and waits for the requests in
flight; their tickets are still run, because the worker stops only afterwards, in the
lifespan's exit, after draining the queue.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from packed_transformers.serving.access import AccessGuard, AccessRules
from packed_transformers.serving.api import RequestError, RequestLimits, read_json, read_request
from packed_transformers.serving.metrics import ServerMetrics
from packed_transformers.serving.policies import PolicySettings
from packed_transformers.serving.scheduler import QueueFull, QueueLimits, Scheduler, TicketFailed

ERROR_TYPES = {404: "validation", 408: "validation", 413: "validation", 422: "validation", 429: "overloaded",
               499: "client", 503: "unhealthy", 504: "timeout"}  # fmt: skip


class Service:
    """What every route shares: the engine, its scheduler and metrics, the limits, the tokenizer
    threads, whether requests are admitted (`ready`); `handle` is every POST route's lifecycle."""

    def __init__(
        self, engine, policy: PolicySettings, queue: QueueLimits, limits: RequestLimits, tokenizer_threads
    ):
        self.engine, self.policy, self.queue, self.limits = engine, policy, queue, limits
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(engine, policy, queue, self.metrics)
        self.tokenizers = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="serving-tokenizer")
        self.ready = False

    @asynccontextmanager
    async def lifespan(self, app):
        # a graph compiled at its first batch, compiled before any request is admitted
        await asyncio.get_running_loop().run_in_executor(None, self.engine.warm_up)
        self.scheduler.start()
        self.ready = True
        try:
            yield
        finally:
            self.ready = False
            await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop, self.queue.timeout_s)
            self.tokenizers.shutdown(wait=True)

    async def body_of(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to exceed the limit: from its
        Content-Length before a byte is read, else once the bytes read pass it. A body that
        has not arrived within limits.body_timeout_s is refused (408): a slow client holds a
        socket, never a worker or a queue slot."""
        most = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > most:
            raise RequestError(413, f"the body has {declared} bytes; at most {most} are accepted")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > most:
                    raise RequestError(413, f"the body exceeds {most} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except TimeoutError:
            raise RequestError(
                408, f"the body did not arrive within {self.limits.body_timeout_s:g} s"
            ) from None

    async def answer_of(self, request: Request, ticket) -> list:
        """The ticket's outputs; the ticket is withdrawn (its queued sequences dropped) if
        its deadline passes (504) or the client disconnects first (499)."""
        outputs = asyncio.ensure_future(asyncio.shield(ticket.future))
        # After the whole body, the only ASGI message left for this request is http.disconnect
        # (the ASGI HTTP spec; uvicorn sends it when the connection is lost).
        left = asyncio.ensure_future(request.receive())
        try:
            done, _ = await asyncio.wait(
                {outputs, left}, timeout=max(ticket.deadline - time.monotonic(), 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )  # fmt: skip
        finally:
            left.cancel()
        if outputs not in done:
            if left in done:
                self.scheduler.withdraw(ticket, 499, "the client disconnected")
            else:
                self.scheduler.withdraw(
                    ticket, 504, f"not answered within the {self.queue.timeout_s:g} s timeout"
                )
        return await outputs  # the withdrawal (or a result that just won) decides

    async def handle(self, request: Request, route: str, required: str, errors) -> Response:
        """The lifecycle every POST route shares: read the body, parse it into the route's
        serving.api.Request, engine.prepare (tokenizer thread), queue, engine.run (worker),
        engine.answer. `errors(status, message)` shapes error bodies."""
        started, status, engine = time.monotonic(), 200, self.engine
        try:
            if engine.task != ROUTE_TASKS[route]:
                raise RequestError(
                    404, f"this server runs {TASK_NAMES[engine.task]} model; use {ROUTES[engine.task]}"
                )
            if not self.ready:
                raise TicketFailed(503, "the server is not ready (starting or shutting down)")
            data = read_json(await self.body_of(request), self.limits, required)
            parsed = read_request(route, data, self.limits, getattr(engine, "dimension", None))
            prepared = await asyncio.get_running_loop().run_in_executor(
                self.tokenizers, engine.prepare, parsed
            )
            ticket = self.scheduler.submit(prepared.token_ids, prepared.segment_ids)
            ticket.future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
            outputs = await self.answer_of(request, ticket)
            response = JSONResponse(engine.answer(prepared, outputs))
            response.headers["x-queue-time"] = f"{ticket.queue_seconds * 1000:.1f}"
            response.headers["x-total-time"] = f"{(time.monotonic() - started) * 1000:.1f}"
        except RequestError as err:
            status, response = err.status, errors(err.status, err.message)
        except QueueFull as err:
            status, response = 429, errors(429, f"overloaded: {err}")
        except TicketFailed as err:
            status, response = err.status, errors(err.status, str(err))
        except ClientDisconnect:  # left while its body was being read: nobody to answer
            status, response = 499, errors(499, "the client disconnected")
        except Exception as err:  # noqa: BLE001 - a bug must still answer, once, and be counted
            first = str(err).splitlines()[0] if str(err) else ""
            status, response = 500, errors(500, f"internal error: {type(err).__name__}: {first[:200]}")
        self.metrics.requests.labels(status=str(status)).inc()
        if status == 200:
            self.metrics.latency.observe(time.monotonic() - started)
        return response

    def endpoint(self, route: str, required: str, errors):
        async def post(request: Request) -> Response:
            return await self.handle(request, route, required, errors)

        return post

    async def health(self) -> JSONResponse:
        alive = self.scheduler.alive
        return JSONResponse(
            {"status": "ok" if alive else "worker stopped"}, status_code=200 if alive else 503
        )

    async def readiness(self) -> JSONResponse:
        ok, scheduler = self.ready and self.scheduler.alive, self.scheduler
        body = {"ready": ok, "queued": scheduler.queued, "queued_tokens": scheduler.queued_tokens}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def info(self) -> dict:
        engine, policy = self.engine, self.policy
        return {
            "task": engine.task, "labels": getattr(engine, "labels", None),
            "dimension": getattr(engine, "dimension", None), "max_input_length": engine.max_length,
            "policy": policy.policy, "max_batch_tokens": policy.max_batch_tokens, "widths": list(policy.widths),
            "max_queue_sequences": self.queue.max_queue_sequences, "timeout_s": self.queue.timeout_s,
            "max_client_batch_size": self.limits.max_inputs,
        }  # fmt: skip


def create_app(
    engine,
    policy: PolicySettings,
    queue: QueueLimits,
    limits: RequestLimits,
    tokenizer_threads: int = 1,
    access: AccessRules | None = None,
):
    """The app; with `access` (serving/access.py: API key, Host and Origin rules) wrapped in
    the AccessGuard that refuses before any route runs."""
    service = Service(engine, policy, queue, limits, tokenizer_threads)
    app = FastAPI(title="packed BERT inference", lifespan=service.lifespan)
    app.state.scheduler, app.state.metrics = service.scheduler, service.metrics
    for route, (path, required, errors) in POST_ROUTES.items():
        app.add_api_route(path, service.endpoint(route, required, errors), methods=["POST"], name=route)
    for path, answer in (("/health", service.health), ("/ready", service.readiness),
                         ("/metrics", service.prometheus), ("/info", service.info)):  # fmt: skip
        app.add_api_route(path, answer, methods=["GET"])
    if access is None:
        return app
    return AccessGuard(app, access, lambda status: service.metrics.requests.labels(status=str(status)).inc())


# The engine task each route is answered by.
ROUTE_TASKS = {"predict": "classification", "rerank": "classification", "qa": "question_answering",
               "tokens": "token_classification", "embed": "embedding", "openai": "embedding"}  # fmt: skip
TASK_NAMES = {"classification": "a classification", "question_answering": "a question-answering",
              "embedding": "an embedding", "token_classification": "a token-classification"}  # fmt: skip
ROUTES = {
    "classification": "POST /predict (or /rerank for a one-label model)",
    "question_answering": "POST /qa",
    "embedding": "POST /embed or /v1/embeddings",
    "token_classification": "POST /tokens",
}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": message, "error_type": ERROR_TYPES.get(status, "backend")}, status_code=status
    )


def _openai_error(status: int, message: str) -> JSONResponse:
    """OpenAI's error body, which its clients read: {"error": {"message", "type", "code"}}."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


# Each POST route: its path, the field its body must hold, the error body its clients read.
POST_ROUTES = {
    "predict": ("/predict", "inputs", _error),
    "rerank": ("/rerank", "query", _error),
    "embed": ("/embed", "inputs", _error),
    "openai": ("/v1/embeddings", "input", _openai_error),
    "qa": ("/qa", "inputs", _error),
    "tokens": ("/tokens", "inputs", _error),
}
