"""Shared fixtures. Slow ones (the tiny model, Airflow, vLLM) are built once and cached under
MODEL_RELEASE_HOME, so a second run of the suite reuses them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import pipeline.entry  # noqa: F401 - installs Airflow as the platform, as every way into the library does
from pipeline.core.paths import PROJECT_ROOT, home

# One vLLM compile cache for the whole suite, also for tests that move MODEL_RELEASE_HOME to a
# temporary directory: it is keyed by the graph, and each cold engine start costs ~35 s here.
os.environ.setdefault("VLLM_CACHE_ROOT", str(home() / "vllm-cache"))

RELEASES = PROJECT_ROOT / "configs" / "releases"
PROD_SPEC = RELEASES / "qwen3-235b-a22b-fp8-mi325x.yaml"
TINY_SPEC = RELEASES / "tiny-qwen3-moe-cpu.yaml"
SERVE_PYTHON = PROJECT_ROOT / ".venv-serve" / "bin" / "python"


MODEL_FIXTURES = {"tiny_model_dir", "fp8_artifact"}
_builder: dict[str, Any] = {}  # "proc": the build (a Popen, or _Adopted)


def _needs_quiet(item: pytest.Item) -> bool:
    """Needs the tiny model, or measures CPU or latency (must not run beside its training)."""
    return bool(MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))) or item.get_closest_marker("quiet") is not None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Tests that need neither the model nor a quiet machine first, so they run while the model
    trains in the background (532 s beside the setup and the first tests in a fresh clone); the
    rest after, each group in file order; last, the tests that share one running engine (`tiny_engine`), so
    it never idles beside a test that measures."""
    items.sort(key=lambda item: (_needs_quiet(item), "tiny_engine" in getattr(item, "fixturenames", ())))


def pytest_collection_finish(session):
    """Start the tiny-model build in a process of its own when a selected test will need it and it
    is not cached; the fixture's build() then waits on the build's lock and reuses the result."""
    from pipeline.core import artifacts
    from pipeline.stages import tiny_model

    if session.config.option.collectonly or not any(
        MODEL_FIXTURES & set(getattr(i, "fixturenames", ())) for i in session.items
    ):
        return
    if artifacts.is_complete(tiny_model.cache_dir(tiny_model.TinyConfig())):
        return
    log_path = home() / "logs" / "tiny-model-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    adopted = _Adopted.from_pid_file(home() / "logs" / "tiny-model-build.pid")
    if adopted is not None:  # scripts/test.sh started it before the setup and the checks
        _builder["proc"] = adopted
        _say(session.config, f"tiny model: building since before the checks (pid {adopted.pid}, log: {log_path})")
        return
    with open(log_path, "w") as log_file:
        _builder["proc"] = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "make-tiny-model"],
            cwd=PROJECT_ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    _say(session.config, f"tiny model: not cached; building it in the background (log: {log_path})")


class _Adopted:
    """The build scripts/test.sh started: our child after its `exec` of pytest, with the parts of
    Popen's interface the hooks here use."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    @classmethod
    def from_pid_file(cls, path: Path) -> _Adopted | None:
        try:
            pid = int(path.read_text())
            running = "make-tiny-model" in Path(f"/proc/{pid}/cmdline").read_text()
        except (OSError, ValueError):
            return None
        return cls(pid) if running else None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # not ours (pytest run another way): alive while its pid is
                if not Path(f"/proc/{self.pid}").exists():
                    self.returncode = 0
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("make-tiny-model", timeout)
            time.sleep(0.5)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def pytest_runtest_setup(item):
    proc = _builder.get("proc")
    if proc is None or proc.poll() is not None or not _needs_quiet(item):
        return
    started = time.monotonic()
    _say(item.config, f"tiny model: {item.nodeid} waits for the background build")
    while proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    _say(
        item.config,
        f"tiny model: build finished (exit {proc.returncode}) after a wait of {time.monotonic() - started:.0f} s",
    )


def _say(config, line: str) -> None:
    """A line in the terminal now, also from inside a test's setup (where output is captured)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n[{line}]")


def pytest_sessionfinish(session):
    """A run stopped early (-x, Ctrl-C) does not leave a trainer behind; its temp dir is cleared next build."""
    proc = _builder.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from pipeline.stages import tiny_model

    return tiny_model.build()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    """One running vLLM engine of the tiny model for the tests that only ask it questions (a start
    is 30-50 s here): served as `tiny` and under the production spec's name, with the tokenizer
    endpoints the serving-path check reads. Yields its base URL."""
    from tests.vllm_engine import engine

    log_path = tmp_path_factory.mktemp("tiny-engine") / "vllm.log"
    names = ("tiny", "qwen3-235b-a22b-fp8")
    with engine(tiny_model_dir, names, log_path, "--enable-tokenizer-info-endpoint") as url:
        yield url


@pytest.fixture
def spec_file(tmp_path):
    """Write a variant of a shipped spec: spec_file(PROD_SPEC, lambda d: ...) -> path."""

    def make(base: Path, edit=None, name: str = "variant.yaml") -> Path:
        data = yaml.safe_load(base.read_text())
        if edit:
            edit(data)
        out = tmp_path / "releases" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(data, sort_keys=False))
        return out

    return make


@pytest.fixture(scope="module")
def s3():
    """A real S3-protocol server (moto, over HTTP) for one test module."""
    from testkit.s3server import MotoServer

    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def release_env(monkeypatch, tmp_path):
    """S3 credentials for the local server and a registry of the test's own."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", f"sqlite:///{tmp_path / 'registry.db'}")


@pytest.fixture
def small_artifact(tmp_path) -> Path:
    """A tiny artifact with a manifest: enough for staging, verification and gate checks."""
    from pipeline.core import artifacts

    root = tmp_path / "fp8-small"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\0" * 4096)
    (root / "config.json").write_text("{}")
    artifacts.write_manifest(root, kind="fp8-model")
    return root


@pytest.fixture(scope="session")
def fp8_artifact(tiny_model_dir) -> Path:
    """The tiny model's real FP8 artifact (llmcompressor), as the quantize stage publishes it."""
    from pipeline.entry import flow

    release = flow.validate_spec(str(TINY_SPEC))
    return Path(flow.quantize(release, flow.materialize_model(release)).path)


@pytest.fixture
def copy_dir(tmp_path):
    def make(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return make
