"""The rollout controller on the local target, killed after each action it takes.

The front is the real nginx and the engines are real processes in their own sessions, found again
by their pid files; they are small HTTP servers answering like vLLM (health, metrics, completions)
so that a kill at every transition costs seconds, not an engine load each (the real engines' rollout
is test_promotion's local-target test). Each step's analysis stands in passing: what is asserted
here is what a dead controller leaves, and what recovery makes of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.core.rollout import WEIGHT_TOTAL
from pipeline.core.specs import load_spec
from pipeline.release import analysis, controller, local_engines, local_target
from pipeline.stages import serving
from testkit.s3server import free_port
from tests.conftest import TINY_SPEC

ENGINE = r"""
import http.server, json, sys
class Engine(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _send(self, body, kind="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/metrics":
            self._send(b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n", "text/plain")
        else:
            self._send(b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(json.dumps({"choices": [{"text": " 46"}], "release": sys.argv[2]}).encode())
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Engine).serve_forever()
"""


class Killed(BaseException):
    """The controller's task, terminated between two actions (not an Exception: nothing catches it)."""


def standin(spec, layout, model_dir, release_id: int, port: int, code: list[str]) -> local_target.Deployment:
    """A stand-in engine process (`python -c *code`) started as the target starts engines: its own
    session, its pid file and log under the release's directory."""
    log_dir = local_target.state_dir(spec.name) / f"release-{release_id}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "engine-0.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", *code, "vllm-standin"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    (log_dir / "engine-0.pid").write_text(str(proc.pid))
    return local_target.Deployment(
        release_id=release_id,
        layout=layout.name,
        model_dir=str(model_dir),
        pgids=[proc.pid],
        ports=[port],
        log_dir=str(log_dir),
    )


def start_engines(spec, hw, layout, model_dir, release_id, timeout, beside=None):
    """The target's engine start, with stand-in engines: detached, pid files, healthy before it returns."""
    port = free_port()
    dep = standin(spec, layout, model_dir, release_id, port, [ENGINE, str(port), str(release_id)])
    deadline = time.monotonic() + 30
    while not local_target.is_healthy(dep):
        assert time.monotonic() < deadline, "stand-in engine not healthy"
        time.sleep(0.05)
    return dep


def passing(number: int, fraction: float, processes: int) -> analysis.StepAnalysis:
    return analysis.StepAnalysis(step=number, fraction=fraction, window_s=0, passed=True, reasons=[], queries={})


ACTIONS = ("mark", "start", "route", "scale_old", "scale_new", "settle")


def killing(target: local_target.LocalRelease, after: int, made: list[str]) -> None:
    """The target's state-changing primitives, counted; the controller dies right after the `after`-th."""
    for name in ACTIONS:
        real = getattr(target, name)

        def act(*args, _real=real, _name=name, **kwargs):
            _real(*args, **kwargs)
            made.append(_name)
            if len(made) == after:
                raise Killed(_name)

        setattr(target, name, act)


def answers(url: str, n: int = 5) -> set[str]:
    """n completions through the front: each must succeed; the releases that answered."""
    seen = set()
    for _ in range(n):
        body = json.dumps({"model": "m", "prompt": "12+34=", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            seen.add(json.loads(response.read())["release"])
    return seen


@pytest.fixture
def spec(spec_file, monkeypatch):
    monkeypatch.setattr(local_target, "_start_engines", start_engines)
    monkeypatch.setattr(local_target, "drain", lambda dep, timeout=120: None)  # the stand-ins hold nothing
    path = spec_file(TINY_SPEC, lambda d: (d.update(name="tiny-killed"), d["serving"].update(port=free_port())))
    loaded = load_spec(path)
    yield loaded
    local_target.stop(loaded.spec.name)
    for pid_file in local_target.state_dir(loaded.spec.name).glob("release-*/engine-*.pid"):
        serving.stop_groups([int(pid_file.read_text())], grace=5)


def rollout(loaded, release_id: int, after: int = 0, made: list[str] | None = None):
    target = local_target.LocalRelease(
        loaded.spec, release_id, loaded.hardware, loaded.layout("single"), Path("/models/tiny")
    )
    if after:
        killing(target, after, made if made is not None else [])
    with local_target.switching(loaded.spec.name):
        return controller.rollout(target, local_target.steps(loaded.spec), passing, 1)


def engines_running(name: str, release_id: int) -> bool:
    files = list((local_target.state_dir(name) / f"release-{release_id}").glob("engine-*.pid"))
    return any(serving.alive_group(int(f.read_text())) for f in files)


def test_a_local_rollout_killed_after_any_action_leaves_a_safe_state_that_recovery_finishes_or_undoes(spec):
    name, url = spec.spec.name, local_target.endpoint(spec.spec)
    assert rollout(spec, 1).status == "live" and answers(url) == {"1"}
    made: list[str] = []
    assert rollout(spec, 2, after=10_000, made=made).status == "live"  # counts the actions of a good rollout
    assert answers(url) == {"2"} and not engines_running(name, 1)
    actions = list(made)
    assert actions[0] == "mark" and actions[-1] == "scale_old", actions  # the record first; the old release last
    assert rollout(spec, 1).status == "live"  # release 1 serves again for the next case (rolled out afresh)

    outcomes = []
    for after in range(1, len(actions) + 1):
        live_before = local_target.current(name)
        assert live_before is not None and live_before.release_id == 1
        with pytest.raises(Killed):
            rollout(spec, 2, after=after, made=[])
        # what the dead controller left: every request succeeds, and only checked, healthy engines answer
        routed = {b: w for b, w in local_target._weights(local_target._front_release(spec.spec)).items() if w}
        assert routed and sum(routed.values()) == WEIGHT_TOTAL, routed
        assert answers(url, 8) <= set(routed), routed
        # the old release never stops before the rollout is over (its last action stops it)
        assert engines_running(name, 1) or after == len(actions)

        with local_target.switching(name):
            recovered = controller.recover(local_target.LocalRelease(spec.spec, 2))
        outcomes.append((actions[after - 1], recovered.status))
        now = local_target.current(name)
        if recovered.status == "live":
            assert now is not None and now.release_id == 2 and answers(url) == {"2"}
            assert not engines_running(name, 1)
        else:
            assert recovered.status == "rolled_back" and now is not None and now.release_id == 1
            assert answers(url) == {"1"} and not engines_running(name, 2)
        with local_target.switching(name):  # a second recovery changes nothing
            again = controller.recover(local_target.LocalRelease(spec.spec, 2))
        assert not [k for k, _ in again.events if k == "traffic"] and again.status == recovered.status
        if recovered.status == "live":  # release 1 back for the next kill point
            assert rollout(spec, 1).status == "live"
    # undone until everything had moved; finished once the route named release 2 alone
    assert [s for _, s in outcomes].count("live") >= 1 and outcomes[0][1] == "rolled_back", outcomes
    assert outcomes[-1][1] == "live", outcomes


def test_a_release_whose_engine_cannot_start_leaves_the_live_one_serving_untouched(spec, monkeypatch):
    """Its engine exits before it is healthy (vLLM refusing its arguments, say): the target's own
    health wait sees it, the controller undoes the rollout before any traffic moved, and the live
    release serves on, its engines never stopped. (A real vLLM refusing bad arguments: test_benchmark.)"""
    name, url = spec.spec.name, local_target.endpoint(spec.spec)
    assert rollout(spec, 1).status == "live"
    live = local_target.current(name)

    def exits_at_once(spec, hw, layout, model_dir, release_id, timeout, beside=None):
        refusal = ["import sys; sys.exit('error: max_num_seqs must be >= 1')"]
        dep = standin(spec, layout, model_dir, release_id, free_port(), refusal)
        local_engines._wait_healthy(dep, timeout)  # the target's own wait: it must see the exit
        return dep

    monkeypatch.setattr(local_target, "_start_engines", exits_at_once)
    failed = rollout(spec, 2)
    assert failed.status != "live" and "engine replica 0 exited before it was healthy" in failed.error, failed
    assert "max_num_seqs must be >= 1" in failed.error  # the engine log's tail comes with it
    now = local_target.current(name)
    assert now is not None and now.release_id == 1 and now.pgids == live.pgids
    assert answers(url, 8) == {"1"} and engines_running(name, 1)
    assert not [k for k, _ in failed.events if k == "traffic"]  # the route never moved
