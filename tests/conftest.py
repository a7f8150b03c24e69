"""Shared fixtures. Slow ones (the tiny model, Airflow, vLLM) are built once and cached under
MODEL_RELEASE_HOME, so a second run of the suite reuses them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import pipeline.entry  # noqa: F401 - installs Airflow as the platform, as every way into the library does
from pipeline.core.paths import PROJECT_ROOT, home

# One vLLM compile cache for the whole suite, also for tests that move MODEL_RELEASE_HOME to a
# temporary directory: it is keyed by the graph (and the CPU's instruction set), and each engine
# configuration's first start with a cold cache compiles (init engine 34.0 s cold vs 8.5 s warm, tiny
# model, 2 cores). The machine's user cache, not the checkout's home: a fresh clone (CI's) starts warm
# on a machine that ran the suite before. Inductor's own cache beside it, named here: torch sets
# TORCHINDUCTOR_CACHE_DIR to its /tmp default in this process once it compiles anything (quantize,
# lm-eval), and engines started after that inherited it, a second cache compiled cold again.
_cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
os.environ.setdefault("VLLM_CACHE_ROOT", str(_cache_home / "model-release" / "vllm-cache"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ["VLLM_CACHE_ROOT"]) / "inductor"))

RELEASES = PROJECT_ROOT / "configs" / "releases"
PROD_SPEC = RELEASES / "qwen3-235b-a22b-fp8-mi325x.yaml"
TINY_SPEC = RELEASES / "tiny-qwen3-moe-cpu.yaml"
SERVE_PYTHON = PROJECT_ROOT / ".venv-serve" / "bin" / "python"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """The tests that share one running engine (`tiny_engine`) last, so it never idles beside a test
    that measures; the rest in file order."""
    items.sort(key=lambda item: "tiny_engine" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session", autouse=True)
def _session_processes(tmp_path_factory) -> None:
    """Processes whose command line names this session's temporary root are this session's
    (tests.processes), beside those naming the checkout."""
    from tests import processes

    processes.ROOTS.append(f"{tmp_path_factory.getbasetemp()}/")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The shipped reference build; MODEL_RELEASE_TEST_TINY_MODEL names another finished build (a
    directory with a manifest: `make-tiny-model --out`) to run the tests that take this fixture on it,
    e.g. a build of another CPU or seed: they must hold for every build the builder can make."""
    from pipeline.core import artifacts
    from pipeline.stages import tiny_model

    other = os.environ.get("MODEL_RELEASE_TEST_TINY_MODEL")
    if other:
        artifacts.verify(Path(other))
        return Path(other)
    return tiny_model.reference()


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


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL for the session (tests/postgres.py), stopped at its end. Under CI=true a
    machine without one fails the suite; elsewhere the tests that need it skip, saying why."""
    from tests.postgres import Server, binaries

    bin_dir = binaries()
    if bin_dir is None:
        why = "no PostgreSQL server (/usr/lib/postgresql/*/bin/initdb): `bash scripts/setup.sh system` installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    server = Server(bin_dir)
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


_durations: dict[str, float] = {}
_session: dict[str, float] = {}


def pytest_sessionstart(session):
    import time as _time

    _session["started"] = _time.time()


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """A whole run of the suite (no selection) leaves its record, as the benchmarks do theirs, under
    MODEL_RELEASE_HOME/results/suite/: counts, minutes, the slowest tests, the machine (CPU model and
    instruction set). Copy one into benchmarks/results/suite/ to keep it (a record written there by the
    suite itself would make the measurements page stale for the next run's docs test)."""
    import time as _time

    from pipeline.core import measurements

    if config.option.keyword or config.option.markexpr or config.args != config.getini("testpaths"):
        return
    counts = {k: len(v) for k, v in terminalreporter.stats.items() if k in ("passed", "failed", "error", "skipped")}
    minutes = (_time.time() - _session["started"]) / 60
    slowest = sorted(_durations.items(), key=lambda kv: -kv[1])[:10]
    path = measurements.record(
        "suite",
        {
            "counts": counts,
            "minutes": round(minutes, 1),
            "slowest": [{"test": t, "seconds": round(s, 1)} for t, s in slowest],
            "exit_status": int(exitstatus),
        },
        summary=", ".join(f"{n} {k}" for k, n in counts.items()) + f" in {minutes:.1f} min",
        command="make test",
        root=home() / "results",
    )
    terminalreporter.write_line(f"suite record: {path}")
