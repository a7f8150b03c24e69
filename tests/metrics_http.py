"""A real HTTP /metrics endpoint for tests: serves whatever `render()` returns at each scrape."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(render: Callable[[], bytes]) -> ThreadingHTTPServer:
    """Start it on a free port (`server.server_address[1]`); `server.shutdown()` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
