"""The embedded Airflow: stopping it stops what it started, even processes in sessions of their own;
its SQLite database makes a writer wait out another's lock instead of failing after 5 s."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from pipeline.embedded.airflow_standalone import Standalone, airflow_env, descendants


def started(script: str, pid_file: Path) -> tuple[Standalone, int]:
    """A stand-in for `airflow standalone` (a bash `script` in a group of its own) and the pid its
    script writes to `pid_file`."""
    standalone = Standalone({"AIRFLOW_HOME": str(pid_file.parent), "AIRFLOW__API__BASE_URL": "http://127.0.0.1:1"})
    standalone.proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return standalone, int(pid_file.read_text())


def assert_gone(pid: int, what: str) -> None:
    """Within 10 s the process has exited (or is a zombie waiting to be reaped by its new parent)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} {pid} still running after stop()")


def test_stop_also_stops_task_processes_that_left_the_standalone_group(tmp_path):
    # stand-in for `airflow standalone`: a group whose child starts a task in a session of its own,
    # the way the executor's task processes (and their vLLM engines) run
    standalone, task = started(f"setsid sleep 300 & echo $! > {tmp_path}/task.pid; wait", tmp_path / "task.pid")
    deadline = time.monotonic() + 10
    while os.getpgid(task) == standalone.proc.pid:  # until setsid has run
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert task in descendants(standalone.proc.pid)  # and killing the standalone's group alone would miss it
    standalone.stop()
    assert_gone(task, "task process")
    assert standalone.proc is None


def test_stop_also_stops_what_outlives_the_standalone_in_its_own_group(tmp_path, caplog):
    """The standalone exits on SIGTERM, a member of its group does not (a scheduler still shutting
    down): after the grace, SIGKILL, and a warning names what outlived it; nothing of the group is left."""
    script = f"(trap '' TERM; echo $BASHPID > {tmp_path}/member.pid; while true; do sleep 0.2; done) & wait"
    standalone, member = started(script, tmp_path / "member.pid")
    leader = standalone.proc.pid
    with caplog.at_level("WARNING", logger="pipeline.stages.serving.isolation"):
        standalone.stop(grace=1)
    assert_gone(member, "group member")
    warned = [r.getMessage() for r in caplog.records if "outlived SIGTERM" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"process group {leader} outlived SIGTERM by 1 s"), warned
    assert "trap '' TERM" in warned[0]  # the member's command line


# Airflow's own engine, built from the embedded environment, writes one row (the REST trigger's
# audit-log INSERT failed this way in CI while the scheduler held the lock)
WRITER = """
from airflow import settings
from sqlalchemy import text
print("ready", flush=True)  # imported (seconds): the wait for the lock starts now
with settings.engine.begin() as connection:
    connection.execute(text("INSERT INTO probe VALUES (1)"))
"""


def test_airflow_waits_for_a_lock_held_longer_than_sqlites_default(tmp_path, monkeypatch):
    monkeypatch.delenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", raising=False)
    env = airflow_env(tmp_path)
    holder = sqlite3.connect(tmp_path / "airflow.db", isolation_level=None)
    holder.execute("PRAGMA journal_mode=WAL")  # as Airflow keeps its database
    holder.execute("CREATE TABLE probe (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")  # the write lock, as a scheduler loop holds it
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert writer.stdout is not None
    first = writer.stdout.readline()
    time.sleep(8)  # SQLite's default wait is 5 s: without the embedded env's wait the INSERT fails
    holder.execute("COMMIT")
    out, _ = writer.communicate(timeout=120)
    assert first == "ready\n" and writer.returncode == 0, first + out
    assert holder.execute("SELECT count(*) FROM probe").fetchone() == (1,)
    # a database the user configured is left alone
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://db/airflow")
    assert airflow_env(tmp_path)["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == "postgresql://db/airflow"
