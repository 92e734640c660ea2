"""uvicorn's h11 protocol with a deadline on each request's headers, which uvicorn has none of (its
keep-alive timer starts only after a first answer, and any byte cancels it): a connection whose
request line and headers are not all in within `read_timeout` seconds of its opening, or of the first
byte of its next request, is closed and counted. The body's own timeout is the app's (`read_body`).

    protocol = with_header_deadline(read_timeout=10, on_timeout=service.count_timeout)
    uvicorn.Config(app, http=protocol, ...)"""

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_deadline(read_timeout: float, on_timeout) -> type[H11Protocol]:
    """An H11Protocol class closing connections that take over `read_timeout` s to send their headers;
    `on_timeout()` is called (on the event loop) for each one closed."""

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(read_timeout, self.headers_too_slow)

        def data_received(self, data: bytes) -> None:
            if self.header_timer is None and self.conn.their_state is h11.IDLE:  # a next request begins
                self.header_timer = self.loop.call_later(read_timeout, self.headers_too_slow)
            super().data_received(data)
            if self.header_timer is not None and self.conn.their_state is not h11.IDLE:  # headers all in
                self.header_timer.cancel()
                self.header_timer = None

        def connection_lost(self, exc) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None
            super().connection_lost(exc)

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                on_timeout()
                self.transport.close()

    return HeaderDeadlineProtocol
