"""The REST client against a server that is slow to answer: a GET (a poll) is asked again, a write
is not (it may have been done)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.airflow.rest import READ_TRIES, AirflowClient
from pipeline.core.errors import AirflowError


def reply_json(handler: BaseHTTPRequestHandler, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class Slow(BaseHTTPRequestHandler):
    stalls = 0  # how many of the next requests under /api/v2 stall past the client's timeout
    seen: list[str] = []

    def _answer(self, body: dict) -> None:
        if self.path.startswith("/api/v2") and Slow.stalls > 0:
            Slow.stalls -= 1
            time.sleep(0.6)
        Slow.seen.append(f"{self.command} {self.path}")
        reply_json(self, body)

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer({"access_token": "t"} if self.path == "/auth/token" else {"dag_run_id": "r"})

    def do_GET(self):  # noqa: N802
        self._answer({"state": "running"})

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Slow.stalls, Slow.seen = 0, []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_poll_that_times_out_is_asked_again(server):
    client = AirflowClient(server, "admin", "pw", timeout=0.3)
    Slow.stalls = READ_TRIES - 1
    assert client.run("r")["state"] == "running"  # the last try answers in time
    Slow.stalls = READ_TRIES
    with pytest.raises(AirflowError, match="no answer in 0.3 s"):
        client.run("r")


def test_a_write_that_times_out_is_not_sent_again(server):
    client = AirflowClient(server, "admin", "pw", timeout=0.3)
    Slow.stalls = 1
    with pytest.raises(AirflowError, match="POST /api/v2/dags/model_release/dagRuns: no answer"):
        client.trigger({"spec": "x"})
    time.sleep(0.5)
    assert [s for s in Slow.seen if s.startswith("POST /api")] == ["POST /api/v2/dags/model_release/dagRuns"]


class Review(BaseHTTPRequestHandler):
    """A human-in-the-loop task waiting for input; a PATCH may stall past the client's timeout,
    having recorded the answer (`record_then_stall`) or not."""

    record_then_stall = True
    stall_next_patch = True
    answered: list[str] | None = None
    patches = 0

    def _json(self, body: dict) -> None:
        reply_json(self, body)

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._json({"access_token": "t"})

    def do_GET(self):  # noqa: N802
        self._json(
            {
                "task_instance": {"state": "running" if Review.answered else "awaiting_input"},
                "created_at": "2026-01-01T00:00:00+00:00",  # asked long ago: no settling wait
                "response_received": Review.answered is not None,
                "chosen_options": Review.answered,
            }
        )

    def do_PATCH(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        Review.patches += 1
        stall, Review.stall_next_patch = Review.stall_next_patch, False
        if not stall or Review.record_then_stall:
            Review.answered = body["chosen_options"]
        if stall:
            time.sleep(0.6)
        self._json({"chosen_options": body["chosen_options"]})

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("recorded", [True, False], ids=["answer-recorded", "answer-lost"])
def test_an_answer_that_times_out_is_read_back_and_sent_again_only_if_it_did_not_land(recorded):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Review)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Review.record_then_stall, Review.stall_next_patch, Review.answered, Review.patches = recorded, True, None, 0
    try:
        client = AirflowClient(f"http://127.0.0.1:{httpd.server_address[1]}", "reviewer", "pw", timeout=0.3)
        client.answer("r", "Abort", "late", "review_step", 1, dag_id="step_reviews")
    finally:
        httpd.shutdown()
    assert Review.answered == ["Abort"]
    assert Review.patches == (1 if recorded else 2)  # sent again only when the first did not land
