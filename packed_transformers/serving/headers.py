"""Request heads bounded in size and in time, below the ASGI app.

uvicorn's httptools protocol reads a request's head (request line and headers) without a
size limit and without a deadline: one client streaming a 200 MB header held the event loop
in the parser for tens of seconds (every other client waited), and clients trickling a
byte a second kept their connections for as long as they liked. The app's own limits
(--max-body-bytes, --body-timeout-s) start only once a head is complete. This protocol adds
their twins for the head:

    --max-header-bytes   bytes of one request's head (431 beyond, the connection closed)
    --header-timeout-s   seconds from a connection's (or a request's) first byte to its
                         head's end (408 after, the connection closed)

`bounded_protocol(limits)` returns the protocol class uvicorn is given (`http=`). Answers
are one JSON line, as the app's refusals are. Never imports the model or the app.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
HEAD_END = b"\r\n\r\n"  # the blank line that ends a request's head


@dataclass(frozen=True)
class HeadLimits:
    """max_bytes: a request head's size; timeout_s: from the first byte to the head's end."""

    max_bytes: int = 64 * 1024
    timeout_s: float = 10.0


def head_refusal(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response refusing a head, closing the connection."""
    body = json.dumps({"error": message, "error_type": "Validation" if status == 431 else "Timeout"}).encode()
    return b"".join([
        b"HTTP/1.1 %d %s\r\n" % (status, REASONS[status]),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
        body,
    ])  # fmt: skip


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the head of every request bounded (module docstring)."""

    head_limits = HeadLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_tail = b""
        self._in_head = True  # a connection that sends nothing is held by the deadline too
        self._head_deadline = None
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Measured before the parser sees the bytes: a head that arrives whole in one read (a
        # 100 KB head against a 2 KB limit) is parsed, completed and handed to the app within
        # one feed, so counting after the parse let it through.
        # Only the head's bytes count: up to and including the blank line that ends it (a body
        # in the same read is not head; counting it refused a kept-alive client's next request).
        # The blank line may be split over two reads: the last bytes of the previous read are
        # searched with this one.
        if self._in_head:
            tail = self._head_tail
            end = (tail + data).find(HEAD_END)
            self._head_bytes += len(data) if end < 0 else end + len(HEAD_END) - len(tail)
            self._head_tail = (tail + data)[-(len(HEAD_END) - 1) :]
            if self._head_bytes > self.head_limits.max_bytes:
                self._refuse(431, f"the request head exceeds {self.head_limits.max_bytes} bytes")
                return
        super().data_received(data)

    # parser callbacks: a head begins and ends
    def on_message_begin(self) -> None:
        super().on_message_begin()
        # a kept-alive connection idle between requests is uvicorn's to close
        # (timeout_keep_alive); the next request's deadline starts at its first byte (its
        # bytes are counted from on_message_complete, before the parser sees them)
        self._in_head = True
        self._arm_deadline()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # the next bytes on a kept-alive connection begin the next head: measured from its
        # first read (its deadline starts at on_message_begin, as before)
        self._in_head = True
        self._head_bytes = 0
        self._head_tail = b""

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._cancel_deadline()
        super().on_headers_complete()

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self._in_head and not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:
                self._refuse(408, f"the request head did not arrive within {self.head_limits.timeout_s:g} s")

    def _arm_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.head_limits.timeout_s, self._head_too_slow)

    def _cancel_deadline(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _refuse(self, status: int, message: str) -> None:
        self._cancel_deadline()
        self._in_head = False
        self.transport.write(head_refusal(status, message))
        self.transport.close()


def bounded_protocol(limits: HeadLimits) -> type[BoundedHeadProtocol]:
    """The protocol class for uvicorn (`uvicorn.run(app, http=...)`) with these limits."""
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,), {"head_limits": limits})
