"""The local target's Prometheus: Debian's `prometheus` server scraping the live engines.

Production reads the cluster's Prometheus; the embedded default runs the same server for the
same PromQL. One per live slot (beside its nginx front), started by the first rollout and
stopped with the slot. Engines come and go through file-based service discovery: a rollout
writes one targets file per release (labels `release`, `layout`), which Prometheus picks up
without a reload. Scraped every second; its data lives as long as the server (a rollout's
windows), and a new server starts empty.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import requests

from pipeline.core.errors import PrometheusError, ReleaseError
from pipeline.core.files import atomic_write
from pipeline.release import analysis
from pipeline.stages import serving

log = logging.getLogger(__name__)

SCRAPE_SECONDS = 1


def binary() -> str:
    path = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(path).exists():
        raise ReleaseError("prometheus is not installed (scripts/setup.sh system installs Debian's package)")
    return path


def _pid(root: Path) -> int | None:
    path = root / "prometheus.pid"
    if not path.exists():
        return None
    pid = int(path.read_text())
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"prometheus" in cmdline and serving.alive_group(pid) else None


def url(root: Path) -> str | None:
    """The running server's URL, or None."""
    port = root / "port"
    return f"http://127.0.0.1:{port.read_text().strip()}" if _pid(root) and port.exists() else None


def ensure(root: Path, timeout: float = 60) -> str:
    """Start the server under `root` unless it runs; return its URL once it is ready."""
    running = url(root)
    if running:
        return running
    # A fresh start: series and targets of a server that was stopped (or killed) belong to engines
    # that are gone; release ids can repeat across registries, and a stale `up` would be read as
    # an engine of the new release that is down. Each rollout registers its engines again.
    shutil.rmtree(root / "data", ignore_errors=True)
    shutil.rmtree(root / "targets", ignore_errors=True)
    (root / "targets").mkdir(parents=True, exist_ok=True)
    config = root / "prometheus.yml"
    atomic_write(
        config,
        f"global: {{scrape_interval: {SCRAPE_SECONDS}s, scrape_timeout: {SCRAPE_SECONDS}s}}\n"
        "scrape_configs:\n"
        "  - job_name: vllm\n"
        f"    file_sd_configs: [{{files: ['{root / 'targets'}/*.json'], refresh_interval: 1s}}]\n",
    )
    port = serving.free_port()
    with open(root / "prometheus.log", "ab") as out:
        proc = subprocess.Popen(
            [
                binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'data'}",
                "--storage.tsdb.retention.time=1d",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # like the front: it outlives the task that started it
        )
    atomic_write(root / "port", str(port))
    atomic_write(root / "prometheus.pid", str(proc.pid))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ReleaseError(f"prometheus exited ({proc.returncode}); log {root / 'prometheus.log'}")
        try:
            if requests.get(f"{base}/-/ready", timeout=2).status_code == 200:
                log.info("prometheus ready at %s (scraping %s every %d s)", base, root / "targets", SCRAPE_SECONDS)
                return base
        except requests.RequestException:
            pass
        time.sleep(0.5)
    stop(root)
    raise ReleaseError(f"prometheus not ready after {timeout:.0f} s; log {root / 'prometheus.log'}")


def scrape(root: Path, release_id: int, layout: str, ports: list[int]) -> None:
    """Scrape these engine ports as `release_id`'s (a file Prometheus watches; written atomically)."""
    targets = [{"targets": [f"127.0.0.1:{p}" for p in ports], "labels": {"release": str(release_id), "layout": layout}}]
    atomic_write(root / "targets" / f"release-{release_id}.json", json.dumps(targets))


def forget(root: Path, release_id: int) -> None:
    (root / "targets" / f"release-{release_id}.json").unlink(missing_ok=True)


def wait_scraped(base: str, release_id: int, count: int, timeout: float = 30) -> None:
    """Until every engine of the release has been scraped up (so a window starts with data)."""
    try:
        analysis.wait_up(base, f'release="{release_id}"', count, timeout)
    except PrometheusError as exc:
        raise ReleaseError(f"release {release_id}: {exc}") from None


def stop(root: Path) -> bool:
    pid = _pid(root)
    if pid is None:
        return False
    serving.stop_groups([pid], grace=10)
    (root / "prometheus.pid").unlink(missing_ok=True)
    return True
