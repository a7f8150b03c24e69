"""The embedded default's object storage: moto's S3-protocol server on localhost.

Started detached by the demo (pid file and log under MODEL_RELEASE_HOME) and reached through
an Airflow connection, exactly as production reaches DigitalOcean Spaces. moto keeps its
state in memory: a restarted server is empty, and staging simply uploads again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline.core.paths import home

PORT = int(os.environ.get("MODEL_RELEASE_S3_PORT", "5055"))
URL = f"http://127.0.0.1:{PORT}"
CONN_ID = "model_release_s3"
# moto accepts any key pair; these are not secrets
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "model-release-local", "AWS_SECRET_ACCESS_KEY": "model-release-local"}


def healthy() -> bool:
    try:
        with urllib.request.urlopen(f"{URL}/moto-api/", timeout=2):
            return True
    except OSError:
        return False


def ensure_running() -> str:
    if healthy():
        return URL
    logs = home() / "logs"
    logs.mkdir(exist_ok=True)
    moto = Path(sys.executable).parent / "moto_server"
    with open(logs / "s3-server.log", "ab") as log:
        proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(PORT)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (home() / "s3-server.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + 60
    while not healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"local S3 server did not start; see {logs / 's3-server.log'}")
        time.sleep(0.3)
    return URL


def stop() -> None:
    pid_file = home() / "s3-server.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
        pid_file.unlink(missing_ok=True)


def env(url: str = URL) -> dict[str, str]:
    """Environment that points Airflow's connection and plain boto3 at the local server."""
    conn = {
        "conn_type": "aws",
        "login": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "password": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "extra": {"endpoint_url": url, "region_name": "us-east-1"},
    }
    return {
        f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps(conn),
        "AWS_ENDPOINT_URL_S3": url,
        "AWS_DEFAULT_REGION": "us-east-1",
        **CREDENTIALS,
    }
