"""The queue between the HTTP handlers and the model: bounded, with deadlines, one worker.

    scheduler = Scheduler(engine, settings, limits, metrics)
    scheduler.start()
    ticket = scheduler.submit(prepared)        # raises QueueFull (-> 429) when it cannot hold it
    outputs = await ticket.future              # per-sequence outputs, in the request's order
    scheduler.stop()                           # answers what is queued, then rejects the rest

A request becomes one `Ticket` holding its sequences (texts or QA windows). Admission is
all or nothing: a ticket enters only if the queue has room for all its sequences (never more
than `max_queue_sequences`) and, where the worker has measured its speed at the batch sizes
the queue would run in, only if the queue with it would run within half the timeout
(serving/admission.py: a request that would run now on an empty queue is never refused for
time): an overloaded server answers 429 at once rather than 504 after the wait. One worker
thread takes batches by the policy (serving/policies.py) and runs the engine; the event
loop never waits on the model. Every admitted ticket ends exactly once: with its outputs,
or with an error (its deadline passed while queued: 504; the server stopped: 503; the
engine failed: 500), or is withdrawn by its handler (the handler's timeout: 504; the client
disconnected: 499), which takes its sequences out of the queue at once. Nothing admitted is
dropped, and nothing is run for a client that has gone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from packed_transformers.serving.admission import MeasuredRates, refusal
from packed_transformers.serving.policies import PolicySettings, plan_batch


class QueueFull(Exception):
    """The queue cannot admit the request now (HTTP 429)."""


class TicketFailed(Exception):
    """A ticket ended without outputs; status is the HTTP code to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class QueueLimits:
    """max_queue_sequences: sequences waiting at most (admission refuses beyond);
    max_wait_ms: how long the packed policy lets a batch fill before it runs (0: like
    TEI, every policy takes what is waiting as soon as the model is free, so the batch is
    what arrived during the last forward); timeout_s: a request's
    deadline from admission."""

    max_queue_sequences: int = 1024
    max_wait_ms: float = 0.0
    timeout_s: float = 30.0


@dataclass
class Ticket:
    """One request's sequences: token_ids / segment_ids, int64 arrays per sequence."""

    token_ids: list
    segment_ids: list
    deadline: float
    outputs: list = field(default_factory=list)
    remaining: int = 0
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None
    queue_seconds: float = 0.0
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _finish(self, error: TicketFailed | None = None) -> bool:
        """End the ticket once (True); later calls do nothing (False). Thread-safe."""
        with self._lock:
            if self._done:
                return False
            self._done = True

        def deliver():
            if self.future.done():
                return
            if error is None:
                self.future.set_result(self.outputs)
            else:
                self.future.set_exception(error)

        self.loop.call_soon_threadsafe(deliver)
        return True

    @property
    def finished(self) -> bool:
        return self._done

    def end(self, status: int, message: str) -> bool:
        """End the ticket with an error (504: the handler's timeout; 499: the client left)."""
        return self._finish(TicketFailed(status, message))


@dataclass
class _Waiting:
    """A queued sequence: its ticket and position in it."""

    ticket: Ticket
    position: int
    length: int
    arrived: float


class Scheduler:
    def __init__(self, engine, settings: PolicySettings, limits: QueueLimits, metrics):
        self.engine, self.settings, self.limits, self.metrics = engine, settings, limits, metrics
        self._queue: deque[_Waiting] = deque()
        self._queued_tokens = 0  # real tokens waiting
        # the worker's tokens/s per batch size; before the first batch, the engine's estimate
        prior = getattr(engine, "cold_tokens_per_second", None)
        self._rates = MeasuredRates(prior_tokens_per_second=prior() if prior else None)
        self._condition = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="serving-worker", daemon=True)

    # ----- the event loop's side --------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, token_ids: list, segment_ids: list) -> Ticket:
        """Admit a request (all of its sequences) or raise QueueFull (429: not now), or
        TicketFailed (413: never, it has more sequences than the queue holds)."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        ticket = Ticket(token_ids, segment_ids, deadline=now + self.limits.timeout_s)
        ticket.loop, ticket.future = loop, loop.create_future()
        ticket.outputs = [None] * len(token_ids)
        ticket.remaining = len(token_ids)
        with self._condition:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(token_ids) > self.limits.max_queue_sequences:  # could never be admitted
                raise TicketFailed(
                    413, f"this request has {len(token_ids)} sequences (QA: windows); the queue holds "
                    f"at most {self.limits.max_queue_sequences}",
                )  # fmt: skip
            tokens = sum(len(t) for t in token_ids)
            reason = refusal(
                len(self._queue), self._queued_tokens, len(token_ids), tokens, self._rates,
                self.limits.max_queue_sequences, self.settings.max_batch_tokens, self.limits.timeout_s,
            )  # fmt: skip
            if reason is not None:
                raise QueueFull(reason)
            self._queued_tokens += tokens
            for position, tokens in enumerate(token_ids):
                self._queue.append(_Waiting(ticket, position, len(tokens), now))
            self._publish_queue()
            self._condition.notify()
        return ticket

    def stop(self, timeout_s: float = 60.0) -> None:
        """Answer what is queued (the worker drains the queue), then fail whatever is left
        after `timeout_s` with 503. Admission is closed from now on."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        self._thread.join(timeout_s)
        with self._condition:
            left = list(self._queue)
            self._queue.clear()
            self._queued_tokens = 0
            self._publish_queue()
        for waiting in left:
            waiting.ticket._finish(TicketFailed(503, "the server stopped before this request ran"))

    def withdraw(self, ticket: Ticket, status: int, message: str) -> bool:
        """The handler stops waiting for `ticket` (its timeout: 504, or its client
        disconnected: 499): end it, and take its sequences still queued out of the queue at
        once, so neither their slots nor their tokens outlive the request. Sequences already
        in a running batch finish there and are discarded. False if the ticket had ended."""
        with self._condition:
            ended = ticket.end(status, message)
            if ended:
                self._drop({id(ticket)})
        return ended

    def _drop(self, ticket_ids: set) -> None:
        """Take every queued sequence of these tickets (by id) out of the queue and its
        token count. Called with the condition held."""
        self._queued_tokens -= sum(w.length for w in self._queue if id(w.ticket) in ticket_ids)
        self._queue = deque(w for w in self._queue if id(w.ticket) not in ticket_ids)
        self._publish_queue()

    def _publish_queue(self) -> None:
        self.metrics.queue_size.set(len(self._queue))
        self.metrics.queue_tokens.set(self._queued_tokens)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ----- the worker thread -----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            waiting, plan = batch
            self._run(waiting, plan)

    def _next_batch(self):
        """Block until a batch is due; take it off the queue. None: stopped and drained."""
        with self._condition:
            while True:
                while not self._queue:
                    if self._stopping:
                        return None
                    self._condition.wait()
                if self.settings.policy == "packed" and not self._stopping:
                    # Let the batch fill: until the budget is met or the oldest waited max_wait.
                    until = self._queue[0].arrived + self.limits.max_wait_ms / 1000
                    while (
                        self._queued_tokens < self.settings.max_batch_tokens
                        and time.monotonic() < until
                        and not self._stopping
                    ):
                        self._condition.wait(max(0.0, until - time.monotonic()))
                now = time.monotonic()
                self._expire(now)
                if self._queue:
                    break
            queue = list(self._queue)
            lengths = np.array([w.length for w in queue], dtype=np.int64)
            waited = np.array([now - w.arrived for w in queue])
            plan = plan_batch(lengths, waited, self.settings)
            chosen = set(plan.chosen.tolist())
            taken = [queue[i] for i in plan.chosen]
            self._queue = deque(w for i, w in enumerate(queue) if i not in chosen)
            self._queued_tokens -= sum(w.length for w in taken)
            self._publish_queue()
        for w in taken:
            self.metrics.queue_seconds.observe(now - w.arrived)
            w.ticket.queue_seconds = max(w.ticket.queue_seconds, now - w.arrived)
        return taken, plan

    def _expire(self, now: float) -> None:
        """Fail (504) every queued ticket whose deadline has passed, and drop the sequences
        of tickets already ended (the handler gave up on them): no work for nobody."""
        ended = {id(w.ticket): w.ticket for w in self._queue if w.ticket.deadline <= now or w.ticket.finished}
        if not ended:
            return
        self._drop(set(ended))
        for ticket in ended.values():
            ticket._finish(TicketFailed(504, f"not run within the {self.limits.timeout_s:g} s timeout"))

    def _run(self, taken: list[_Waiting], plan) -> None:
        token_ids = [w.ticket.token_ids[w.position] for w in taken]
        segment_ids = [w.ticket.segment_ids[w.position] for w in taken]
        started = time.monotonic()
        try:
            outputs = self.engine.run(token_ids, segment_ids, plan.table, plan.width)
        except Exception as err:  # noqa: BLE001 - every ticket must end; the error is reported
            message = (
                f"inference failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            )
            for ticket in {id(w.ticket): w.ticket for w in taken}.values():
                ticket._finish(TicketFailed(500, message))
            return
        real = int(sum(len(t) for t in token_ids))
        with self._condition:  # read by submit() on the event loop's thread
            self._rates.observe(real, time.monotonic() - started)
        self.metrics.observe_batch(real, plan.padded_tokens, len(taken))
        for w, output in zip(taken, outputs):
            ticket = w.ticket
            ticket.outputs[w.position] = output
            ticket.remaining -= 1
            if ticket.remaining == 0:
                ticket._finish()
