"""Stopping the embedded Airflow stops what it started, even processes in sessions of their own."""

from __future__ import annotations

import os
import subprocess
import time

from pipeline.embedded.airflow_standalone import Standalone, descendants


def test_stop_also_stops_task_processes_that_left_the_standalone_group(tmp_path):
    # stand-in for `airflow standalone`: a group whose child starts a task in a session of its own,
    # the way the executor's task processes (and their vLLM engines) run
    script = f"setsid sleep 300 & echo $! > {tmp_path}/task.pid; wait"
    standalone = Standalone({"AIRFLOW_HOME": str(tmp_path), "AIRFLOW__API__BASE_URL": "http://127.0.0.1:1"})
    standalone.proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (tmp_path / "task.pid").exists() or not (tmp_path / "task.pid").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    task = int((tmp_path / "task.pid").read_text())
    while os.getpgid(task) == standalone.proc.pid:  # until setsid has run
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert task in descendants(standalone.proc.pid)  # and killing the standalone's group alone would miss it
    standalone.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{task}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":  # exited, waiting to be reaped by its (new) parent
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"task process {task} still running after stop()")
    assert standalone.proc is None
