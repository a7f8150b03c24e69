"""A small client of Airflow's public REST API (v2): what ML-ops and reviewers do from a shell.

Trigger a release, watch its tasks, and answer the approval as a named reviewer through the
human-in-the-loop endpoint, exactly as the UI does. Authentication is Airflow's own: a JWT
from `POST /auth/token` for a user of the auth manager. Passwords are never logged.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import requests

from pipeline.core.errors import AirflowError

log = logging.getLogger(__name__)

DAG_ID = "model_release"
READ_TRIES = 4  # a GET that times out is asked again (see AirflowClient._call)
# How long a parked task (deferred, or awaiting a person's input) stays parked before anything
# resumes it. Airflow 3.3's scheduler fails a resumed attempt that is already running when it
# takes in the executor's late "success" for the parked attempt's exit (apache/airflow#72716 and
# #71580, fix open in #72767); on a loaded 2-core machine that report came 5 s after the exit.
SETTLE_S = 10.0


class AirflowClient:
    def __init__(self, base_url: str, username: str, password: str, timeout: float = 30):
        self.base = base_url.rstrip("/")
        self.username = username
        self.timeout = timeout
        self.session = requests.Session()
        try:
            response = self.session.post(
                f"{self.base}/auth/token", json={"username": username, "password": password}, timeout=timeout
            )
        except requests.ConnectionError:
            raise AirflowError(f"cannot reach Airflow at {self.base} (is it running?)") from None
        if response.status_code >= 400:
            raise AirflowError(f"{self.base}/auth/token: login as {username!r} refused ({response.status_code})")
        self.token = response.json()["access_token"]
        self.session.headers["Authorization"] = f"Bearer {self.token}"

    def _call(self, method: str, path: str, missing_ok: bool = False, **kwargs: Any) -> Any:
        """The JSON answer; None for a 404 where `missing_ok` (something not there yet). A GET that
        times out is asked again, up to READ_TRIES times: on the embedded default Airflow yields the
        CPU to a measurement for a probe's length (serving.isolated), and a poll may wait that long."""
        for attempt in range(1, (READ_TRIES if method == "GET" else 1) + 1):
            try:
                response = self.session.request(method, f"{self.base}/api/v2{path}", timeout=self.timeout, **kwargs)
                break
            except requests.Timeout:
                if attempt == READ_TRIES or method != "GET":
                    raise AirflowError(f"{method} /api/v2{path}: no answer in {self.timeout:g} s") from None
                log.info("GET /api/v2%s: no answer in %g s (try %d of %d)", path, self.timeout, attempt, READ_TRIES)
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code >= 400:
            raise AirflowError(f"{method} /api/v2{path}: {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None

    def trigger(self, conf: dict[str, Any], dag_id: str = DAG_ID, run_id: str | None = None) -> str:
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if run_id:
            body["dag_run_id"] = run_id
        return self._call("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"]

    def run(self, run_id: str, dag_id: str = DAG_ID) -> dict[str, Any]:
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def task_states(self, run_id: str, dag_id: str = DAG_ID) -> dict[str, str]:
        """task_id (with [map index]) -> state, for a progress line."""
        items = self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        out = {}
        for ti in items["task_instances"]:
            key = ti["task_id"] + (f"[{ti['map_index']}]" if ti.get("map_index", -1) >= 0 else "")
            out[key] = ti["state"] or "none"
        return out

    def pending_approval(self, run_id: str, dag_id: str = DAG_ID) -> dict[str, Any] | None:
        """The HITL request of the run still waiting for an answer, if any."""
        items = self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/hitlDetails")
        for item in items.get("hitl_details", []):
            if not item.get("response_received"):
                return item
        return None

    def respond(
        self, run_id: str, approve: bool, comment: str = "", task_id: str = "approve", dag_id: str = DAG_ID
    ) -> dict[str, Any]:
        return self.answer(run_id, "Approve" if approve else "Reject", comment, task_id, dag_id=dag_id)

    def answer(
        self,
        run_id: str,
        option: str,
        comment: str = "",
        task_id: str = "approve",
        map_index: int = -1,
        dag_id: str = DAG_ID,
        wait_s: float = 60,
    ) -> dict[str, Any]:
        """Answer a human-in-the-loop task (a mapped one by its index) once it has waited for input
        for `SETTLE_S` (by its request's age, or else as seen from here): an answer that resumes the
        task before the scheduler has taken in the exit of its parked attempt gets the resumed one
        marked failed (see SETTLE_S)."""
        path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/hitlDetails"
        key = task_id + (f"[{map_index}]" if map_index >= 0 else "")
        deadline = time.monotonic() + wait_s
        parked_since = None
        while True:
            # the request carries its task instance's state; 404 until the task has asked
            detail = self._call("GET", path, missing_ok=True)
            if not detail or detail["task_instance"]["state"] != "awaiting_input":
                parked_since = None
            else:
                parked_since = parked_since or time.monotonic()
                age = (datetime.now(UTC) - datetime.fromisoformat(detail["created_at"])).total_seconds()
                if max(age, time.monotonic() - parked_since) >= SETTLE_S:
                    break
            if time.monotonic() > deadline:
                raise AirflowError(f"run {run_id}: task {key} is not waiting for an answer")
            time.sleep(1)
        body = {"chosen_options": [option], "params_input": {"comment": comment}}
        for attempt in range(1, READ_TRIES + 1):
            try:
                return self._call("PATCH", path, json=body)
            except AirflowError as exc:
                if "no answer in" not in str(exc):
                    raise
                # the API server was starved (Airflow yields the CPU to a measurement for a probe's
                # length): the answer may have landed. Read back; send again only while it has not.
                seen = self._call("GET", path, missing_ok=True) or {}
                if seen.get("response_received"):
                    if seen.get("chosen_options") != [option]:
                        raise AirflowError(
                            f"run {run_id}: task {key} was answered {seen.get('chosen_options')}"
                        ) from None
                    return seen
                if attempt == READ_TRIES:
                    raise
                log.info("PATCH %s: no answer in %g s; not recorded yet, sending again", path, self.timeout)
        raise AssertionError("unreachable")

    def wait(
        self,
        run_id: str,
        until: str = "finished",
        timeout: float = 3600,
        poll: float = 10,
        on_progress=None,
        dag_id: str = DAG_ID,
        task_id: str = "approve",
    ) -> str:
        """Poll until the run finishes (or, with until="approval", waits for a reviewer).

        "Waiting for a reviewer" means the approval task is parked in awaiting_input on two polls
        in a row (`poll` apart: at least SETTLE_S by default), not merely that its request exists:
        the request is written before the task parks, and an answer racing the park makes Airflow
        3.3 fail the task (seen in CI; see SETTLE_S).
        """
        started = time.monotonic()
        last = None
        parked = 0
        while time.monotonic() - started < timeout:
            state = self.run(run_id, dag_id)["state"]
            states = self.task_states(run_id, dag_id)
            if on_progress and states != last:
                on_progress(states, time.monotonic() - started)
                last = states
            if state in ("success", "failed"):
                return state
            if until == "approval":
                parked = (
                    parked + 1
                    if states.get(task_id) == "awaiting_input" and self.pending_approval(run_id, dag_id)
                    else 0
                )
                if parked >= 2:
                    return "awaiting_approval"
            time.sleep(poll)
        raise AirflowError(f"run {run_id} still {state} after {timeout:.0f} s")
