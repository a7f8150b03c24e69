"""`model-release`: one command, a sub-command per stage, each a thin call into `pipeline`.

Errors a user can fix print one line per problem and exit 1; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from pipeline.core.errors import ReleaseError, SpecError

# Results go to the real stdout; while a command runs, sys.stdout points at stderr, because the
# libraries we drive (llmcompressor's loguru sink, tqdm, lm-eval) print progress to stdout.
_results = sys.stdout


def emit(text: str) -> None:
    print(text, file=_results, flush=True)


# Argument types: a value no command can use is refused by argparse itself, one line naming the
# option (exit 2), before anything loads or starts.


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def need_dir(path: str | None, option: str) -> None:
    """A model or artifact directory a command reads, checked before anything loads or starts: a
    typo is one line, not a model loader's traceback from deep inside an engine start. (Not an
    argparse type: the pod commands' arguments are parsed where their paths do not exist.)"""
    if path is not None and not Path(path).is_dir():
        raise ReleaseError(f"{option} {path}: no such directory")


def _validate(args: argparse.Namespace) -> int:
    from pipeline.core.spec import load_spec

    failed = False
    for path in args.spec:
        try:
            loaded = load_spec(path)
        except SpecError as exc:
            failed = True
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            continue
        spec = loaded.spec
        emit(
            f"{path}: ok: {spec.model.name} {spec.quantization.scheme}, {len(spec.layouts)} layouts"
            f" ({', '.join(layout.name for layout in spec.layouts)}) on {loaded.hardware.name}"
        )
    return 1 if failed else 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from pipeline.core import artifacts
    from pipeline.stages import tiny_model

    # a build stopped with SIGTERM exits through Python, so its half-trained temporary directory is
    # removed rather than left beside the cache
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # only what is asked for overrides TinyConfig: its defaults are the model the suite and the demo use
    given = {"seed": args.seed, "steps": args.steps}
    cfg = tiny_model.TinyConfig(**{k: v for k, v in given.items() if v is not None})
    path = tiny_model.build(Path(args.out) if args.out else None, cfg)
    meta = artifacts.read_manifest(path).meta
    emit(json.dumps({"path": str(path), "accuracy": meta.get("accuracy"), "train_seconds": meta.get("train_seconds")}))
    return 0


def _tiny_accuracy(args: argparse.Namespace) -> int:
    from pipeline.stages import tiny_model

    need_dir(args.model, "--model")
    path = Path(args.model) if args.model else tiny_model.build()
    for task in args.task:
        acc = tiny_model.greedy_accuracy(path, task, limit=args.limit)
        emit(f"{task}: exact-match accuracy {acc:.3f} on held-out items (chance is below 0.01)")
    return 0


def _materialize(args: argparse.Namespace) -> int:
    from pipeline.core.spec import load_spec
    from pipeline.stages import sources

    loaded = load_spec(args.spec)
    emit(sources.materialize(loaded.spec, loaded.path.parent).model_dump_json(indent=2))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from pipeline.core.spec import load_spec
    from pipeline.stages import quantize, sources

    loaded = load_spec(args.spec)
    source = sources.materialize(loaded.spec, loaded.path.parent)
    emit(quantize.quantize(loaded.spec, source, args.method).model_dump_json(indent=2))
    return 0


def _stage(args: argparse.Namespace) -> int:
    from pipeline.entry import flow

    spec_path = str(Path(args.spec).resolve())
    need_dir(args.artifact, "--artifact")
    staged = (
        flow.stage_artifact(spec_path, str(Path(args.artifact).resolve())) if args.artifact else flow.stage(spec_path)
    )
    emit(json.dumps(staged, indent=2))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from pipeline.core import storage

    emit(storage.fetch(args.uri, Path(args.dest)).model_dump_json(indent=2))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from pipeline.entry import flow

    spec_path = str(Path(args.spec).resolve())
    need_dir(args.candidate, "--candidate")
    if args.side:  # one side only, result to storage: what an evaluation pod runs (execution: kubernetes)
        from pipeline.entry import pod_steps

        if not args.results:
            raise ReleaseError("evaluate --side needs --results URI (where the pod writes its result)")
        if args.side == "candidate" and not args.candidate:
            raise ReleaseError("evaluate --side candidate needs --candidate DIR")
        emit(json.dumps(pod_steps.evaluate_side(spec_path, args.side, args.results, args.run_id, args.candidate)))
        return 0
    # a given candidate is verified before the source is materialized (a tiny-model build takes minutes)
    given = {"path": args.candidate, "manifest_hash": _hash_of(args.candidate)} if args.candidate else None
    source = flow.materialize_model(spec_path)
    candidate = given or flow.quantize(spec_path, source)
    baseline = flow.evaluate(spec_path, source, baseline=True)
    result = flow.evaluate(spec_path, candidate, baseline=False)
    decision = flow.accuracy_gate(spec_path, baseline, result, args.run_id)
    emit(f"accuracy gate passed; GX validation report: {decision['validation_html']}")
    return 0


def _benchmark(args: argparse.Namespace) -> int:
    """One layout's SLO search; exit 0 even when the layout failed (its result says so)."""
    from pipeline.entry import pod_steps

    need_dir(args.model, "--model")
    emit(
        json.dumps(
            pod_steps.benchmark_layout(
                str(Path(args.spec).resolve()), args.layout, args.model, args.results, args.run_id, args.predictions
            )
        )
    )
    return 0


def _remeasure(args: argparse.Namespace) -> int:
    """A live release's re-benchmark on this node; exit 0 when it could not measure (the stored
    result says why, and the judge task alerts with it)."""
    from pipeline.core.spec import load_spec
    from pipeline.entry import pod_steps

    # the arguments themselves are checked first: a layout or a source that is not there is the
    # caller's mistake (exit 1), not a measurement that could not be made
    load_spec(args.spec).layout(args.layout)
    if not (args.s3_uri or args.nfs_path):
        raise ReleaseError("remeasure: give --s3-uri or --nfs-path (where the release's artifact is staged)")
    staged = {"s3_uri": args.s3_uri, "nfs_path": args.nfs_path, "manifest_hash": args.manifest_hash}
    emit(
        json.dumps(
            pod_steps.remeasure(
                str(Path(args.spec).resolve()),
                args.release,
                args.layout,
                staged,
                args.promoted_rate,
                args.results,
                args.run_id,
                args.evaluation,
            )
        )
    )
    return 0


def _manifests(args: argparse.Namespace) -> int:
    from pipeline.core.spec import load_spec
    from pipeline.k8s import manifests

    loaded = load_spec(args.spec)
    if not (args.layout or args.monitoring):
        raise ReleaseError("manifests: give --layout NAME (or --monitoring)")
    if args.monitoring:  # once per model, beside the releases' objects
        from pipeline.k8s import monitoring

        problems = monitoring.validate_pod_monitor(monitoring.pod_monitor(loaded))
        if problems:
            raise ReleaseError("rendered PodMonitor fails the operator's CRD schema:\n" + "\n".join(problems))
        emit(monitoring.to_yaml(loaded))
        return 0
    staging = loaded.spec.staging
    s3_uri, nfs_path, preview = args.s3_uri, args.nfs_path, ""
    if not (s3_uri or nfs_path):
        # a preview from the spec's own staging targets: where a staged artifact would be
        from pipeline.core import storage

        name = "ARTIFACT"
        nfs_path = str(Path(staging.nfs.path) / name) if staging.nfs else None
        s3_uri = storage.s3_uri(staging.s3, name) if staging.s3 else None
        preview = (
            f"# preview from {loaded.path.name}'s staging targets: artifact name {name!r} and manifest hash "
            f"{args.manifest_hash[:12]}… are placeholders; a promotion renders the staged artifact's "
            "(or pass --nfs-path / --s3-uri / --manifest-hash)\n"
        )
    artifact = manifests.Artifact(s3_uri=s3_uri, nfs_path=nfs_path, manifest_hash=args.manifest_hash)
    objs = manifests.render(
        loaded, args.layout, args.release_id, artifact, manifests.RenderOptions(autoscale_rate=args.autoscale_rate)
    )
    problems = manifests.validate(objs)
    if problems:
        raise ReleaseError("rendered manifests fail schema validation:\n" + "\n".join(problems))
    emit(preview + manifests.to_yaml(objs))
    return 0


def _given_rates(values: list[str], layouts: list[str], default: str | None) -> dict[str, float]:
    """`R` (for --layout or the spec's first layout) or `LAYOUT=R`, each a positive req/s per server."""
    rates: dict[str, float] = {}
    for value in values:
        name, _, number = value.rpartition("=")
        name = name or default or layouts[0]
        if name not in layouts:
            raise ReleaseError(
                f"--rate-per-server {value}: no layout {name!r} in the spec (known: {', '.join(layouts)})"
            )
        try:
            rate = float(number)
        except ValueError:
            raise ReleaseError(f"--rate-per-server {value}: expected R or LAYOUT=R with R in req/s") from None
        if not rate > 0:
            raise ReleaseError(f"--rate-per-server {value}: must be a positive req/s")
        rates[name] = rate
    return rates


def _capacity(args: argparse.Namespace) -> int:
    """Fleet and cost for planning, from a given rate or the newest measured one; no benchmark runs."""
    from pipeline.core.spec import load_spec
    from pipeline.release import registry
    from pipeline.stages import capacity

    loaded = load_spec(args.spec)
    spec = loaded.spec
    if spec.capacity is None:
        raise ReleaseError(f"{loaded.path}: capacity: missing; give peak_rps and mean_rps (see configs/releases/)")
    reg = registry.Registry()
    live = reg.live(spec.name, spec.promotion.target)
    versus = capacity.versus_live(live.id, live.data, loaded.hardware) if live else None
    if args.rate_per_server:
        rates = _given_rates(args.rate_per_server, [layout.name for layout in spec.layouts], args.layout)
        best = max(rates, key=lambda name: rates[name])  # what the SLO selection would choose
        loads = dict.fromkeys(rates, args.load_seconds) if args.load_seconds else None
        plan = capacity.plan(loaded, rates, best, versus, source="given", load_seconds=loads, load_source="given")
        given = ", ".join(f"{name} {rate:g}" for name, rate in rates.items())
        origin = f"rates per server given on the command line ({given} req/s); candidate: {best}"
    else:
        measured = next((r for r in reg.releases(name=spec.name) if capacity.recorded_rate(r.data)), None)
        if measured is None:
            raise ReleaseError(
                f"{spec.name}: no release in {reg.safe_url} has a measured rate per server; give --rate-per-server R"
            )
        layout = measured.data.get("layout") or "?"
        rate = capacity.recorded_rate(measured.data) or 0.0
        same = live is not None and measured.id == live.id
        recorded_load = max(measured.data.get("load_seconds") or [], default=None)
        load = args.load_seconds or recorded_load
        plan = capacity.plan(
            loaded,
            {layout: rate},
            layout,
            None if same else versus,
            source="recorded",
            load_seconds={layout: load} if load else None,
            load_source="given" if args.load_seconds else f"measured by release {measured.id}",
        )
        origin = f"rate per server {rate:.4g} req/s measured by release {measured.id} ({measured.status}, {layout})"
    assert plan is not None  # the spec has capacity:
    emit(f"{spec.name}: {origin}")
    emit(capacity.table(plan))
    if args.json:
        emit(plan.model_dump_json(indent=2))
    return 0


def _rollout_plan(args: argparse.Namespace) -> int:
    """What a rollout would run at each step, from the registry or given rates; changes nothing."""
    from pipeline.core.spec import load_spec
    from pipeline.release import registry, rollout_plan

    loaded = load_spec(args.spec)
    spec = loaded.spec
    if args.release is not None:
        reg = registry.Registry()
        plan = rollout_plan.for_release(loaded, reg.get(args.release), reg.live(spec.name, spec.promotion.target))
    else:
        if args.rate_per_server is None:
            raise ReleaseError("give --release ID (a release in the registry) or --rate-per-server R")
        layout = args.layout or spec.layouts[0].name
        loaded.layout(layout)  # an unknown name fails here, naming the spec's layouts
        new = rollout_plan.Side(layout=layout, rate_per_server=args.rate_per_server, load_seconds=args.load_seconds)
        old = (
            rollout_plan.Side(
                layout=args.live_layout, rate_per_server=args.live_rate_per_server, load_seconds=args.live_load_seconds
            )
            if args.live_rate_per_server
            else None
        )
        plan = rollout_plan.plan(loaded, new, old)
    emit(rollout_plan.table(plan))
    if args.json:
        emit(plan.model_dump_json(indent=2))
    return 0 if plan.feasible else 1


def _plan(args: argparse.Namespace) -> int:
    """Predict every feasible layout's max SLO rate from the step-time model (fitted by the newest
    profiling run of this hardware and engine image, else the datasheet's); no engine starts."""
    from pipeline.core.paths import home
    from pipeline.core.spec import load_spec
    from pipeline.planner import plan as planner
    from pipeline.release.registry import cached

    loaded = load_spec(args.spec)
    fitted = None if args.datasheet else cached().profile(loaded.hardware.name, loaded.spec.serving.engine_image)
    result = planner.plan(loaded, args.input_len, args.output_len, profile=fitted)
    emit(planner.table(result, limit=None if args.all else 8))
    for line in planner.comparisons(result):
        emit(line)
    png = Path(args.png) if args.png else home() / "plans" / f"{result.spec}-{result.input_len}-{result.output_len}.png"
    emit(f"chart: {planner.chart(result, png)}")
    if args.json:
        emit(result.model_dump_json(indent=2))
    return 0


def _profile(args: argparse.Namespace) -> int:
    """Fit the planner's step-time coefficients on this machine's engine; kept in the registry."""
    from pipeline.entry import flow
    from pipeline.planner import profile as profiling

    need_dir(args.model, "--model")
    profiled = flow.profile_engine(args.spec, args.layout, args.model, save=not args.no_save)
    emit(profiling.table(profiled))
    emit(profiled.summary() + ("" if args.no_save else " (kept in the registry: `model-release plan` uses it)"))
    if args.json:
        emit(profiled.model_dump_json(indent=2))
    return 0


def _releases(args: argparse.Namespace) -> int:
    from pipeline.release import registry

    reg = registry.Registry()
    if args.action == "show":
        emit(registry.audit_trail(reg, args.id))
        return 0
    if args.action == "rollback":
        from pipeline.release import promote

        chosen = reg.get(args.to) if args.to else None
        name = args.name or (chosen.name if chosen else None)
        if not name:
            raise ReleaseError("releases rollback: give --name NAME or --to ID")
        known = chosen or next(iter(reg.releases(name=name)), None)
        if known is None:
            raise ReleaseError(f"releases rollback: no releases named {name!r} in {reg.safe_url}")
        rel = promote.rollback(reg, name, known.target, getattr(args, "as"), args.reason, to=args.to)
        emit(f"release {rel.id} is {rel.status} again ({rel.data.get('endpoint')})")
        return 0
    rows = reg.releases(name=args.name, status=args.status)
    emit(f"{'id':>4}  {'release':28} {'status':12} {'target':10} {'layout':14} {'req/s/server':>12}  created (UTC)")
    for rel in rows:
        rate = rel.data.get("rate_per_server")
        emit(
            f"{rel.id:>4}  {rel.name:28} {rel.status:12} {rel.target:10} {str(rel.data.get('layout') or '-'):14} "
            f"{(f'{rate:.3g}' if isinstance(rate, (int, float)) else '-'):>12}  {rel.created_at:%Y-%m-%d %H:%M}"
        )
    return 0


def _respond(args: argparse.Namespace) -> int:
    from pipeline.airflow.rest import AirflowClient
    from pipeline.core.paths import home

    user = getattr(args, "as")
    # AIRFLOW_PASSWORD, else the embedded Airflow's generated passwords file (make demo's users)
    local = Path(os.environ.get("AIRFLOW_HOME") or home() / "airflow") / "passwords.json"
    password = os.environ.get("AIRFLOW_PASSWORD") or (
        json.loads(local.read_text()).get(user) if local.exists() else None
    )
    if not password:
        raise ReleaseError(f"no password for Airflow user {user!r}: set AIRFLOW_PASSWORD")
    client = AirflowClient(args.url, user, password)
    approve = args.command == "approve"
    client.respond(args.run_id, approve, args.comment or "")
    emit(f"{'approved' if approve else 'rejected'} run {args.run_id} as {user}")
    return 0


def _hash_of(path: str) -> str:
    from pipeline.core import artifacts

    return artifacts.verify(Path(path)).content_hash()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="model-release",
        description="Take a MoE LLM from a BF16 checkpoint to SLO-verified vLLM serving, one stage at a time.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "validate", help="check release specs: types, then feasibility (fits the node, weights fit memory)"
    )
    p.add_argument("spec", nargs="+", help="release spec YAML (configs/releases/*.yaml)")
    p.set_defaults(func=_validate)

    p = sub.add_parser(
        "make-tiny-model", help="build (or reuse) the tiny Qwen3-MoE trained on CPU; prints path and accuracy"
    )
    p.add_argument("--out", help="directory to create (default: cached under MODEL_RELEASE_HOME/models)")
    p.add_argument("--seed", type=int, help="training seed (default: the cached model's)")
    p.add_argument("--steps", type=positive_int, help="training steps (default: the cached model's)")
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("tiny-accuracy", help="greedy exact-match accuracy of the tiny model on its held-out tasks")
    p.add_argument("--model", help="model directory (default: the cached tiny model)")
    p.add_argument("--task", nargs="+", default=["tiny_add", "tiny_copy"])
    p.add_argument("--limit", type=positive_int)
    p.set_defaults(func=_tiny_accuracy)

    p = sub.add_parser("materialize", help="resolve the spec's model source to a local directory and its manifest hash")
    p.add_argument("spec")
    p.set_defaults(func=_materialize)

    p = sub.add_parser(
        "quantize",
        help="FP8-quantize the spec's model with llmcompressor (or the streaming converter), "
        "verify and publish it content-addressed; a re-run with the same inputs is a no-op",
    )
    p.add_argument("spec")
    p.add_argument(
        "--method", choices=["oneshot", "model_free", "streaming"], help="override quantization.method from the spec"
    )
    p.set_defaults(func=_quantize)

    p = sub.add_parser(
        "evaluate",
        help="lm-eval on the baseline and the FP8 candidate with the spec's tasks, then the "
        "accuracy gate (great-expectations); exit 1 with the per-task table when it fails",
    )
    p.add_argument("spec")
    p.add_argument(
        "--candidate", help="candidate model directory with a manifest (default: the spec's quantized model)"
    )
    p.add_argument("--run-id", default="cli", help="results go to MODEL_RELEASE_HOME/runs/RUN_ID/")
    p.add_argument(
        "--side",
        choices=["baseline", "candidate"],
        help="evaluate one side only (no gate) and write its result to --results (what an evaluation pod runs)",
    )
    p.add_argument("--results", help="s3://bucket/prefix or a directory for --side results")
    p.set_defaults(func=_evaluate)

    p = sub.add_parser(
        "benchmark",
        help="serve a model with one layout and find its highest rate within the p90 SLO; "
        "the result goes to --results (what a benchmark pod runs)",
    )
    p.add_argument("spec")
    p.add_argument("--layout", required=True)
    p.add_argument("--model", required=True, help="model directory the engine loads")
    p.add_argument("--run-id", required=True)
    p.add_argument("--results", required=True, help="s3://bucket/prefix or a directory")
    p.add_argument(
        "--predictions", help="the planner's predictions (s3:// or a path): the search starts from this layout's"
    )
    p.set_defaults(func=_benchmark)

    p = sub.add_parser(
        "remeasure",
        help="re-benchmark a live release's layout and staged artifact on a fresh "
        "engine (short search + its promoted rate); the result goes to --results (the re-benchmark pod)",
    )
    p.add_argument("spec")
    p.add_argument("--release", type=int, required=True, help="registry id of the release")
    p.add_argument("--layout", required=True)
    p.add_argument("--s3-uri", help="s3:// URI the release was staged to")
    p.add_argument("--nfs-path", help="NFS path the release was staged to")
    p.add_argument("--manifest-hash", required=True)
    p.add_argument("--promoted-rate", type=positive_float, required=True, help="req/s the release was promoted at")
    p.add_argument("--run-id", required=True)
    p.add_argument("--results", required=True, help="s3://bucket/prefix or a directory")
    p.add_argument(
        "--evaluation", help="the accuracy gate's results it was released on (s3:// or a path): answers held to them"
    )
    p.set_defaults(func=_remeasure)

    p = sub.add_parser(
        "stage",
        help="upload the FP8 artifact to the spec's S3/Spaces prefix and/or NFS path; "
        "manifest last, resumable, verified; unchanged artifacts are not re-sent",
    )
    p.add_argument("spec")
    p.add_argument(
        "--artifact", help="artifact directory (default: quantize the spec's model, reusing a finished output)"
    )
    p.set_defaults(func=_stage)

    p = sub.add_parser(
        "fetch",
        help="download an artifact (s3://bucket/prefix or an NFS path) and verify every file "
        "against its manifest; what a serving pod's init container runs",
    )
    p.add_argument("uri")
    p.add_argument("dest")
    p.set_defaults(func=_fetch)

    p = sub.add_parser(
        "manifests",
        help="render (and schema-validate) the Kubernetes objects a promotion applies "
        "for a layout: Deployments per replica group, Service, PDB, weights volume",
    )
    p.add_argument("spec")
    p.add_argument("--layout", help="the layout to render (required unless --monitoring)")
    p.add_argument(
        "--monitoring",
        action="store_true",
        help="instead: the PodMonitor (and the equivalent plain scrape config) through which the cluster's "
        "Prometheus labels each engine's series with its release, as the rollout analysis selects them",
    )
    p.add_argument("--release-id", default="preview")
    p.add_argument("--manifest-hash", default="0" * 64)
    p.add_argument("--s3-uri")
    p.add_argument("--nfs-path")
    p.add_argument(
        "--autoscale-rate",
        type=positive_float,
        help="the release's max SLO req/s per server: also its KEDA ScaledObjects (spec capacity.autoscale), paused",
    )
    p.set_defaults(func=_manifests)

    p = sub.add_parser(
        "capacity", help="servers the spec's peak needs and $/M tokens, from a given or recorded rate (no benchmark)"
    )
    p.add_argument("spec", help="release spec YAML with a capacity: section")
    p.add_argument(
        "--rate-per-server",
        action="append",
        metavar="[LAYOUT=]R",
        help="max SLO req/s per server of a layout; repeat to compare layouts (default: the newest measured rate)",
    )
    p.add_argument("--layout", help="the layout a bare R is for (default: the spec's first)")
    p.add_argument(
        "--load-seconds",
        type=positive_float,
        help="a replica's load time, engine start to healthy: the scale-up lead time (default: the measured one)",
    )
    p.add_argument("--json", action="store_true", help="also print the plan as JSON")
    p.set_defaults(func=_capacity)

    p = sub.add_parser(
        "plan", help="predict each feasible layout's max SLO rate per server (step-time model + scheduler simulation)"
    )
    p.add_argument("spec")
    p.add_argument("--input-len", type=positive_int, help="prompt tokens (default: the spec's workload)")
    p.add_argument("--output-len", type=positive_int, help="output tokens (default: the spec's workload)")
    p.add_argument("--all", action="store_true", help="print every feasible layout, not the best 8")
    p.add_argument("--datasheet", action="store_true", help="the hardware profile's own figures, not a profiling run's")
    p.add_argument("--png", help="where to write the chart (default: $MODEL_RELEASE_HOME/plans/SPEC-IN-OUT.png)")
    p.add_argument("--json", action="store_true", help="also print the plan as JSON")
    p.set_defaults(func=_plan)

    p = sub.add_parser(
        "profile",
        help="fit the planner's step-time coefficients on this machine's engine: a few fixed batch shapes"
        " through vLLM's client (about a minute and a half on cpu-local, engine start included)",
    )
    p.add_argument("spec")
    p.add_argument("--layout", help="a layout of one replica (default: the spec's first)")
    p.add_argument("--model", help="model directory the engine loads (default: the spec's model source)")
    p.add_argument("--no-save", action="store_true", help="print the fit, keep nothing in the registry")
    p.add_argument("--json", action="store_true", help="also print the profile as JSON")
    p.set_defaults(func=_profile)

    p = sub.add_parser(
        "rollout-plan", help="a progressive rollout's steps: servers old/new, capacity vs peak, expected duration"
    )
    p.add_argument("spec")
    p.add_argument("--release", type=int, help="the release to roll out (registry); else give its rate")
    p.add_argument("--rate-per-server", type=positive_float, help="the new release's max SLO req/s per server")
    p.add_argument("--layout", help="the new release's layout (default: the spec's first)")
    p.add_argument("--load-seconds", type=positive_float, help="its replicas' load time, process start to healthy")
    p.add_argument("--live-rate-per-server", type=positive_float, help="the live release's rate (none: nothing live)")
    p.add_argument("--live-layout", help="the live release's layout")
    p.add_argument(
        "--live-load-seconds", type=positive_float, help="the live release's load time: what an abort reloads"
    )
    p.add_argument("--json", action="store_true", help="also print the plan as JSON")
    p.set_defaults(func=_rollout_plan)

    p = sub.add_parser("releases", help="the release registry: list, show a release's audit trail, roll back")
    rs = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = rs.add_parser("list", help="releases, newest first")
    q.add_argument("--name")
    q.add_argument("--status")
    q = rs.add_parser("show", help="a release with its full audit trail")
    q.add_argument("id", type=int)
    q = rs.add_parser(
        "rollback", help="put back the release that served before the live one (or --to ID); records who and why"
    )
    q.add_argument("--name", help="release name (spec name); default: that of --to")
    q.add_argument("--to", type=int, help="release id to restore (default: the previous one that served)")
    q.add_argument("--reason", required=True)
    q.add_argument("--as", required=True, metavar="USER", help="who rolls back (recorded)")
    p.set_defaults(func=_releases)

    for name, verb in (("approve", "approve"), ("reject", "reject")):
        p = sub.add_parser(
            name,
            help=f"{verb} a release run waiting for review, as a reviewer, over Airflow's REST API "
            "(the same human-in-the-loop endpoint the UI uses)",
        )
        p.add_argument("run_id")
        p.add_argument("--as", required=True, metavar="USER", help="a reviewer named in the spec (an Airflow user)")
        p.add_argument("--comment", help="recorded in the audit trail")
        p.add_argument(
            "--url", default=os.environ.get("AIRFLOW_URL", "http://localhost:8080"), help="Airflow API server"
        )
        p.set_defaults(func=_respond)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    global _results
    _results = sys.stdout
    sys.stdout = sys.stderr
    try:
        return args.func(args)
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = _results


if __name__ == "__main__":
    sys.exit(main())
