"""A real HTTP endpoint for tests (a /metrics page to scrape, an engine's completions): answers
every GET and POST with whatever `render()` returns at that moment (None: 503, a page that is
unavailable just then, as a loaded engine's scrape can be)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

METRICS = "text/plain; version=0.0.4"


def serve(render: Callable[[], bytes | None], content_type: str = METRICS, status: int = 200) -> ThreadingHTTPServer:
    """Start it on a free port (`server.server_address[1]`), answering with `status`; `server.shutdown()` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = render()
            if body is None:
                self.send_error(503)
                return
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))  # the request, unread otherwise
            self.do_GET()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
