"""Run this repo's DAGs in a real, local Airflow (embedded default, tests, the demo).

One place knows how the embedded Airflow is configured: its home under MODEL_RELEASE_HOME,
this repo's dags/ and plugins/, no example DAGs, the venv's bin on PATH (Airflow
launches its own components from PATH), and its SQLite database's lock wait.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.airflow import pools
from pipeline.airflow.rest import AirflowClient
from pipeline.core.errors import AirflowError
from pipeline.core.paths import PROJECT_ROOT, home
from pipeline.embedded import local_s3
from pipeline.stages.serving import stop_groups

# Seconds a writer to the embedded SQLite database waits for another's lock. SQLite's default is
# 5: on two busy cores the scheduler can hold the write lock longer, and a REST trigger then failed
# with "500 Database error" (its audit-log INSERT, "database is locked"), seen in CI.
SQLITE_LOCK_WAIT_S = 60


def sqlite_url(airflow_home: Path) -> str:
    """The embedded metadata database; `timeout` is pysqlite's busy wait, read from the URL by SQLAlchemy."""
    return f"sqlite:///{airflow_home / 'airflow.db'}?timeout={SQLITE_LOCK_WAIT_S}"


def airflow_env(airflow_home: Path | None = None) -> dict[str, str]:
    airflow_home = airflow_home or home() / "airflow"
    airflow_home.mkdir(parents=True, exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ)
    # a database configured by the user (Postgres, say) is theirs; otherwise SQLite in this home
    env.setdefault("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", sqlite_url(airflow_home))
    env.update(
        {
            "AIRFLOW_HOME": str(airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(PROJECT_ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "MODEL_RELEASE_HOME": str(home()),
            "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
        }
    )
    env.update(local_s3.env())
    return env


def airflow(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "airflow"), *args], env=env, **kwargs)


def ensure_db(env: dict[str, str]) -> None:
    """`airflow db migrate` is idempotent and takes seconds on SQLite."""
    airflow(["db", "migrate"], env, check=True, capture_output=True)


# ---------------------------------------------------------------- airflow standalone, as users see it

# Named users of Airflow's simple auth manager: an operator and the reviewer named in the tiny
# spec. HITL assigned_users needs named users (with all-admins on, nobody may answer).
USERS = {"admin": "admin", "reviewer": "user"}


def passwords(airflow_home: Path) -> dict[str, str]:
    """The users' passwords: generated once per AIRFLOW_HOME (not in the repo), kept in a 0600 file."""
    import json
    import secrets

    path = airflow_home / "passwords.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    if set(USERS) - set(known):
        known = {user: known.get(user) or secrets.token_urlsafe(12) for user in USERS}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not even briefly
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(known))
    return known


def standalone_env(airflow_home: Path | None = None, port: int = 8080) -> dict[str, str]:
    env = airflow_env(airflow_home)
    home_dir = Path(env["AIRFLOW_HOME"])
    passwords(home_dir)
    env.update(
        {
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{u}:{r}" for u, r in USERS.items()),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home_dir / "passwords.json"),
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://localhost:{port}",
            "AIRFLOW__API__HOST": "127.0.0.1",
            # two cores: one task at a time keeps the benchmark honest and the machine responsive
            "AIRFLOW__CORE__PARALLELISM": "2",
            # while a layout is measured Airflow yields the frontend core on purpose (serving.isolated:
            # its session's autogroup at nice 19), so for a probe's length its processes run only when
            # the engine leaves the core idle: waits that would time out then are given room (a DAG
            # file's parse, a task's heartbeat to the API server; the defaults are 30, 50 and 5 s)
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "180",
            "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "240",
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "60",
        }
    )
    return env


class Standalone:
    """`airflow standalone` (api-server, scheduler, dag-processor, triggerer) for this repo's DAGs."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.home = Path(env["AIRFLOW_HOME"])
        self.url = env["AIRFLOW__API__BASE_URL"]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> None:
        import urllib.request

        log_path = self.home / "standalone.log"
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "airflow"), "standalone"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (self.home / "standalone.pid").write_text(str(self.proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"airflow standalone exited ({self.proc.returncode}); see {log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=3) as response:
                    if response.status == 200 and self._dag_ready():
                        pools.ensure(self.client())
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"airflow standalone not ready after {timeout:.0f} s; see {log_path}")

    def client(self, user: str = "admin"):
        return AirflowClient(self.url, user, passwords(self.home)[user])

    def _dag_ready(self, dag_id: str = "model_release") -> bool:
        try:
            self.client()._call("GET", f"/dags/{dag_id}")
            return True
        except AirflowError:
            return False

    def wait_dag(self, dag_id: str, timeout: float = 120) -> None:
        """Until the DAG is parsed and served (another bundle's DAGs may come after this repo's)."""
        deadline = time.monotonic() + timeout
        while not self._dag_ready(dag_id):
            if time.monotonic() > deadline:
                raise AirflowError(f"DAG {dag_id} not served after {timeout:.0f} s")
            time.sleep(2)

    def stop(self, grace: float = 30) -> None:
        """Stop Airflow and every task process it started. Task processes run in sessions of their
        own (a re-benchmark woken by the demo's promotion, say) and outlive the standalone's group,
        so they are found first, by parentage, and stopped after it (their engines go with them)."""
        import signal

        if self.proc is None:
            return
        strays = set()
        for pid in descendants(self.proc.pid):
            try:
                strays.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        strays.discard(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

        # the leader gone, its group may not be: a scheduler still shutting down outlived it by an hour
        # once (an e2e whose first request timed out); what is left gets the grace, then SIGKILL
        stop_groups(strays | {self.proc.pid}, grace=grace)
        (self.home / "standalone.pid").unlink(missing_ok=True)
        self.proc = None


def descendants(root: int) -> list[int]:
    """Every process below `root` in the process tree, whatever its session."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
