"""A real S3-protocol server (moto's server mode) on localhost, and a TCP proxy that injects faults."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoServer:
    def __init__(self, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        moto = Path(sys.executable).parent / "moto_server"
        self.proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class FaultProxy:
    """Forwards TCP to `upstream`; after `cut_after` client bytes it drops every connection,
    and the first `fail_first` connections get `fail_status` (a 503 Slow Down, or the 500 a loaded
    server answers) instead of reaching the server."""

    def __init__(
        self, upstream_port: int, cut_after: int | None = None, fail_first: int = 0, fail_status: str = "503 Slow Down"
    ):
        self.upstream_port, self.cut_after, self.fail_first = upstream_port, cut_after, fail_first
        self.fail_status = fail_status
        self.forwarded = 0
        self.failed = 0
        self.lock = threading.Lock()
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self.lock:
            inject = self.failed < self.fail_first
            self.failed += inject
        if inject:
            client.recv(65536)
            client.sendall(f"HTTP/1.1 {self.fail_status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            client.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()
        self._pipe(client, upstream, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(65536):
                if count:
                    with self.lock:
                        self.forwarded += len(data)
                        over = self.cut_after is not None and self.forwarded > self.cut_after
                    if over:
                        break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.closed = True
        self.server.close()
