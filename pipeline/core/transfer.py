"""The bounds every transfer of an artifact shares, and its progress log.

Part sizes and thread counts set a stage's and a fetch's memory (storage's docstring states the
budget); they live here, below the S3 client (its connection pool holds every concurrent request),
the upload and the fetch, so each reads the same figures. A test shrinks them in the module that
reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MiB = 1024 * 1024
PART_SIZE = 16 * MiB  # upload part; S3 allows 10,000 parts, so larger files get larger parts
MULTIPART_THRESHOLD = 16 * MiB
FETCH_PART = 32 * MiB  # download range
WORKERS = 8  # concurrent requests of one stage or fetch; the client's connection pool holds them all
# threads that read (and sha256) local files, each file in order. One: files go up one after another,
# so each multipart upload's completion (slow on moto: it joins the parts) overlaps the next file's
# parts, where four readers left four completions for the end; it reads ~1 GB/s while hashing
READERS = 1
FINISHERS = 2  # threads that complete multipart uploads (slow on some servers) while the readers go on
MAX_PARTS = 10_000


@dataclass
class Progress:
    """Thread-safe byte counter that logs what, how far and how fast, at most every few seconds."""

    what: str
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    last_log: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if now - self.last_log >= 3 or self.done >= self.total:
                self.last_log = now
                rate = self.done / 1e6 / max(now - self.started, 1e-9)
                log.info(
                    "%s: %.1f/%.1f MB (%.0f%%), %.1f MB/s",
                    self.what,
                    self.done / 1e6,
                    self.total / 1e6,
                    100 * self.done / max(self.total, 1),
                    rate,
                )


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n
