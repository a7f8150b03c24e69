"""Every door of the `model-release` CLI, walked as a new user walks it.

The parser is enumerated (every sub-command and every option), and each door is either walked by a
case below on cheap inputs of the embedded default, or exempt with a reason: a new sub-command or
option fails `test_every_door_is_walked_or_exempt` until it is one or the other. A user error exits
non-zero with one line naming the file, field or object (argparse's own refusals: its usage and one
`error:` line, exit 2), and never a traceback; an unexpected error keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.core import artifacts
from pipeline.core.paths import PROJECT_ROOT
from tests.conftest import PROD_SPEC, TINY_SPEC

pytestmark = pytest.mark.usefixtures("release_env")


def doors(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[str]:
    """'COMMAND' and 'COMMAND --option' for every sub-command (nested ones as 'releases show');
    positional arguments belong to their command's door."""
    found: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.add(" ".join((*path, name)))
                found |= doors(sub, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            found.add(" ".join((*path, max(action.option_strings, key=len))).strip())
    return found


@dataclass(frozen=True)
class Case:
    """One walk through a door: `argv` with {placeholders} from the `world` fixture, the exit code,
    and a pattern the output must match (stdout when it succeeds, the error line when it fails)."""

    id: str
    argv: str
    code: int
    expect: str


CASES = [
    # validate: the model for every other command's errors
    Case("validate-ok", "validate {prod}", 0, r"ok: .* on mi325x-8"),
    Case("validate-missing", "validate {tmp}/nope.yaml", 1, r"nope\.yaml: file not found"),
    Case("validate-bad-field", "validate {bad_spec}", 1, r"slo\.max_p90_ttft_ms"),
    Case(
        "tiny-accuracy-no-model",
        "tiny-accuracy --model {tmp}/nope --task tiny_add --limit 5",
        1,
        r"--model .*nope: no such directory",
    ),
    Case("tiny-accuracy-bad-limit", "tiny-accuracy --limit 0", 2, r"--limit: must be positive"),
    Case("make-tiny-model-bad-steps", "make-tiny-model --steps -1", 2, r"--steps: must be positive"),
    Case("materialize-missing-spec", "materialize {tmp}/nope.yaml", 1, r"nope\.yaml: file not found"),
    Case("quantize-bad-method", "quantize {tiny} --method bogus", 2, r"--method: invalid choice: 'bogus'"),
    Case("quantize-missing-spec", "quantize {tmp}/nope.yaml", 1, r"nope\.yaml: file not found"),
    Case(
        "evaluate-no-candidate-dir",
        "evaluate {tiny} --candidate {tmp}/nope --run-id cli",
        1,
        r"--candidate .*nope: no such directory",
    ),
    Case(
        "evaluate-candidate-no-manifest",
        "evaluate {tiny} --candidate {tmp}",
        1,
        r"no manifest\.json; not a finished artifact",
    ),
    Case("evaluate-side-no-results", "evaluate {tiny} --side baseline", 1, r"--side needs --results"),
    Case(
        "evaluate-side-no-candidate",
        "evaluate {tiny} --side candidate --results {tmp}/r",
        1,
        r"--side candidate needs --candidate",
    ),
    Case(
        "benchmark-unknown-layout",
        "benchmark {tiny} --layout nope --model {good} --run-id r --results {tmp}/r",
        1,
        r"layouts: no layout named 'nope' \(known: single, two-replicas\)",
    ),
    Case(
        "benchmark-no-model",
        "benchmark {tiny} --layout single --model {tmp}/nope --run-id r --results {tmp}/r",
        1,
        r"--model .*nope: no such directory",
    ),
    Case(
        "benchmark-no-predictions",
        "benchmark {tiny} --layout single --model {good} --run-id r --results {tmp}/r --predictions {tmp}/nope.json",
        1,
        r"nope\.json: no such result",
    ),
    Case(
        "remeasure-unknown-layout",
        "remeasure {tiny} --release 1 --layout nope --s3-uri s3://b/p --manifest-hash abc --promoted-rate 10"
        " --run-id r --results {tmp}/r --evaluation {tmp}/e.json",
        1,
        r"no layout named 'nope'",
    ),
    Case(
        "remeasure-no-source",
        "remeasure {tiny} --release 1 --layout single --manifest-hash abc --promoted-rate 10"
        " --run-id r --results {tmp}/r",
        1,
        r"give --s3-uri or --nfs-path",
    ),
    Case(
        "remeasure-bad-rate",
        "remeasure {tiny} --release 1 --layout single --nfs-path {tmp} --manifest-hash abc --promoted-rate -1"
        " --run-id r --results {tmp}/r",
        2,
        r"--promoted-rate: must be positive",
    ),
    # stage: the door of issue 42 (a dict where a record was expected crashed every input)
    Case("stage-good", "stage {tiny} --artifact {good}", 0, r'"manifest_hash": "[0-9a-f]{64}"'),
    Case("stage-flipped", "stage {tiny} --artifact {flipped}", 1, r"flipped/model\.safetensors: sha256 does not match"),
    Case("stage-truncated", "stage {tiny} --artifact {truncated}", 1, r"truncated/model\.safetensors: size 4000 bytes"),
    Case("stage-no-manifest", "stage {tiny} --artifact {bare}", 1, r"bare: no manifest\.json; not a finished artifact"),
    Case("stage-no-dir", "stage {tiny} --artifact {tmp}/nope", 1, r"--artifact .*nope: no such directory"),
    Case("stage-unreachable", "stage {unreachable} --artifact {good}", 1, r"127\.0\.0\.1:9"),
    Case("fetch-no-manifest", "fetch {bare} {tmp}/dest", 1, r"bare: no manifest\.json"),
    Case("fetch-good", "fetch {good} {tmp}/dest", 0, r'"manifest_hash"'),
    Case(
        "manifests-ok",
        "manifests {prod} --layout tp4-ep4-x2 --release-id 7 --manifest-hash {hash} --s3-uri s3://b/p",
        0,
        r"kind: Deployment",
    ),
    Case(
        "manifests-nfs",
        "manifests {prod} --layout tp8-ep8 --nfs-path /mnt/models/x --autoscale-rate 12.5",
        0,
        r"persistentVolumeClaim[\s\S]*kind: ScaledObject",
    ),
    Case(  # the startup probe from a measured load time: (2 x 600 s + 120 s) / 10 s, not the size's 253
        "manifests-load-seconds",
        "manifests {prod} --layout tp8-ep8 --nfs-path /mnt/models/x --load-seconds 600",
        0,
        r"failureThreshold: 132\n",
    ),
    Case(
        "manifests-unknown-layout",
        "manifests {prod} --layout nope",
        1,
        r"no layout named 'nope' \(known: tp8-ep8, tp4-ep4-x2\)",
    ),
    Case("manifests-monitoring", "manifests {prod} --monitoring", 0, r"kind: PodMonitor"),
    Case("manifests-no-layout", "manifests {prod}", 1, r"give --layout NAME"),
    Case(
        "capacity-given",
        "capacity {prod} --rate-per-server 10 --layout tp8-ep8 --load-seconds 600 --json",
        0,
        r"node to add: 2505 s",
    ),
    Case("capacity-unknown-layout", "capacity {prod} --rate-per-server nope=1", 1, r"no layout 'nope'"),
    Case("capacity-nothing-measured", "capacity {prod}", 1, r"no release .* has a measured rate"),
    Case(
        "plan-ok",
        "plan {prod} --input-len 5600 --output-len 140 --all --datasheet --png {tmp}/p.png --json",
        0,
        r"tp4-ep4-x2",
    ),
    Case("plan-bad-length", "plan {prod} --input-len 0", 2, r"--input-len: must be positive"),
    Case("profile-unknown-layout", "profile {tiny} --layout nope --no-save --json", 1, r"no layout named 'nope'"),
    Case("profile-no-model", "profile {tiny} --model {tmp}/nope", 1, r"--model .*nope: no such directory"),
    Case(
        "rollout-plan-given",
        "rollout-plan {prod} --rate-per-server 18 --layout tp4-ep4-x2 --load-seconds 600"
        " --live-rate-per-server 12.5 --live-layout tp8-ep8 --live-load-seconds 540 --json",
        0,
        r"3 reloads \(18\.0 min\)",  # the controller's undo: 2 waves, the widest the budget leaves
    ),
    Case(
        "rollout-plan-keda-grown",
        "rollout-plan {prod} --rate-per-server 18 --layout tp4-ep4-x2 --live-rate-per-server 12.5 --live-servers 12",
        0,
        r"live fleet 12 servers \(12 running now\), the new one 12",  # never fewer than the live fleet runs
    ),
    Case(
        "rollout-plan-bad-rate", "rollout-plan {prod} --rate-per-server -5", 2, r"--rate-per-server: must be positive"
    ),
    Case("rollout-plan-unknown-release", "rollout-plan {prod} --release 999", 1, r"release 999: no such release"),
    Case("releases-list", "releases list --name nope --status live", 0, r"id\s+release"),
    Case("releases-show-unknown", "releases show 999", 1, r"release 999: no such release"),
    Case(
        "releases-rollback-unknown", "releases rollback --name nope --reason r --as sre", 1, r"no releases named 'nope'"
    ),
    Case(
        "releases-rollback-to-unknown",
        "releases rollback --to 999 --reason r --as sre",
        1,
        r"release 999: no such release",
    ),
    Case("recover-unknown", "recover nope --as sre --wait 0", 1, r"model 'nope': no releases of this name"),
    Case(
        "approve-unreachable",
        "approve run-1 --as reviewer --comment ok --url http://127.0.0.1:9",
        1,
        r"cannot reach Airflow at http://127\.0\.0\.1:9",
    ),
    Case(
        "reject-unreachable",
        "reject run-1 --as reviewer --comment no --url http://127.0.0.1:9",
        1,
        r"cannot reach Airflow",
    ),
    Case(
        "platform-ok",
        "platform {prod} --nfs-server 10.110.0.10 --nfs-path /share --gateway-class cilium"
        " --gateway-network internal --worker-account airflow-worker",
        0,
        r"kind: Gateway\n",
    ),
    Case("platform-local-spec", "platform {tiny} --nfs-server h --nfs-path /p", 1, r"promotion\.target is 'local'"),
    Case(
        "preflight-local-spec", "preflight {tiny} --worker-account airflow-worker", 1, r"promotion\.target is 'local'"
    ),
    Case("releases-migrate", "releases migrate --url sqlite:///{tmp}/registry.db", 0, r"at revision \d+ \(was none\)"),
    Case(
        "releases-migrate-unreachable",
        "releases migrate --url postgresql://u:p@127.0.0.1:9/registry",
        1,
        r"registry postgresql\+psycopg://u:\*\*\*@127\.0\.0\.1:9/registry: cannot connect",
    ),
    Case("verbose", "--verbose validate {tmp}/nope.yaml", 1, r"file not found"),
]

# Doors no case walks, each with why: a walk would take minutes or Airflow, and another test runs it.
EXEMPT = {
    "make-tiny-model": "trains for minutes; tests/test_tiny_model.py drives this command through cli.main",
    "make-tiny-model --out": "a build (minutes): tests/test_tiny_model.py builds through tiny_model.build",
    "make-tiny-model --seed": "a build: tests/test_tiny_model.py passes --seed through cli.main (build stubbed)",
    "tiny-accuracy --task": "greedy decoding of the tiny model: tests/test_tiny_model.py calls greedy_accuracy",
    "materialize": "builds or reuses the tiny model (minutes on a fresh clone): conftest's fixtures materialize",
    "quantize": "llmcompressor on the tiny model: tests/test_quantize.py runs this command in a subprocess",
    "evaluate": "lm-eval on both sides (minutes): tests/test_evaluate.py runs the same stage functions",
    "benchmark": "an SLO search on a live engine (minutes): tests/test_benchmark.py runs benchmark.benchmark_layout",
    "remeasure": "a re-benchmark on a live engine: tests/test_k8s_pods.py runs pod_steps.remeasure",
    "profile": "a profiling run on an engine (a minute and a half): tests/test_planner.py profiles a simulated server",
    "profile --model": "the profiling run's model: tests/test_planner.py",
    "rollout-plan --release": "a plan from registry releases: tests/test_rollout.py runs this command",
    "releases show": "an audit trail: tests/test_promotion.py runs this command (the unknown id is walked here)",
    "releases rollback --to": "a real rollback: tests/test_promotion.py runs promote.rollback (unknown ids walked)",
    "approve": "needs Airflow with a waiting approval: tests/test_e2e.py answers through the same "
    "AirflowClient.respond (an unreachable server and a missing password are walked here)",
    "reject": "needs Airflow with a waiting approval: as approve",
    "verify-staged": "needs an artifact staged to S3: tests/test_storage.py walks it through cli.main against the "
    "local S3 server, to success, another release's hash and a deleted object",
    "verify-staged --manifest-hash": "as verify-staged",
    "preflight --kubeconfig": "a cluster to check: tests/test_k8s_preflight.py runs this command against the fake "
    "API server holding the rendered install, one missing piece at a time",
}


def _walked(case: Case, known: set[str]) -> set[str]:
    words = case.argv.split()
    if words[0] == "--verbose":
        return {"--verbose"}
    nested = len(words) > 1 and not words[1].startswith("-") and f"{words[0]} {words[1]}" in known
    command = f"{words[0]} {words[1]}" if nested else words[0]
    return {words[0], command} | {f"{command} {w}" for w in words if f"{command} {w}" in known}


def test_every_door_is_walked_or_exempt():
    known = doors(cli.parser())
    walked = set().union(*(_walked(case, known) for case in CASES))
    walked_ok = {d for case in CASES if case.code == 0 for d in _walked(case, known)}
    assert sorted(known - walked - set(EXEMPT)) == [], "doors neither walked nor exempt: add a case or a reason"
    assert sorted(set(EXEMPT) - known) == [], "exemptions for doors that no longer exist"
    # an exempt door has its success elsewhere; one a case here walks to success needs no exemption
    assert sorted(walked_ok & set(EXEMPT)) == [], "exempt doors that a case walks to success: drop the exemption"
    assert {"stage", "stage --artifact", "fetch", "manifests"} <= walked_ok


@pytest.fixture
def world(tmp_path, spec_file, s3, small_artifact):
    """Cheap inputs of the embedded default: the tiny spec staging to the local S3 server, good and
    damaged artifacts, a spec with a bad field, one whose S3 server does not answer."""

    def to_s3(url):
        def edit(data):
            data["staging"]["s3"].update(
                {"endpoint_url": url, "connection_id": "not-configured", "bucket": "cli", "create_bucket": True}
            )

        return edit

    tiny = spec_file(TINY_SPEC, to_s3(s3.url), "tiny.yaml")
    unreachable = spec_file(TINY_SPEC, to_s3("http://127.0.0.1:9"), "unreachable.yaml")
    bad_spec = spec_file(TINY_SPEC, lambda d: d["slo"].update(max_p90_ttft_ms="fast"), "bad.yaml")

    def damaged(name, change):
        root = tmp_path / name
        root.mkdir()
        for path in small_artifact.iterdir():
            (root / path.name).write_bytes(path.read_bytes())
        change(root / "model.safetensors")
        return root

    flipped = damaged("flipped", lambda p: p.write_bytes(b"\1" + p.read_bytes()[1:]))
    truncated = damaged("truncated", lambda p: p.write_bytes(p.read_bytes()[:4000]))
    bare = damaged("bare", lambda p: None)
    (bare / artifacts.MANIFEST).unlink()
    return {
        "tmp": tmp_path,
        "prod": PROD_SPEC,
        "tiny": tiny,
        "unreachable": unreachable,
        "bad_spec": bad_spec,
        "good": small_artifact,
        "flipped": flipped,
        "truncated": truncated,
        "bare": bare,
        "hash": artifacts.verify(small_artifact).content_hash(),
    }


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d[T ]\d\d:\d\d")  # the task-log lines every command writes to stderr


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """`model-release ARGV` in this process; the handler its logging set up on this test's
    captured stderr goes with the test (a later test would log into a closed stream)."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_door(case, world, capsys, monkeypatch):
    monkeypatch.setenv("AIRFLOW_PASSWORD", "not-used")  # approve/reject reach the (absent) server
    argv = [word.format(**world) for word in case.argv.split()]
    code, out, err = _run(argv, capsys)
    assert "Traceback" not in out + err
    assert code == case.code, (code, out[-2000:], err[-2000:])
    if code == 0:
        assert re.search(case.expect, out), out[-2000:]
        return
    lines = [line for line in err.splitlines() if line.strip() and not LOG_LINE.match(line)]
    if code == 2:  # argparse: its usage, then one line naming the option
        assert lines[0].startswith("usage:") and ": error: " in lines[-1], lines
        assert re.search(case.expect, lines[-1]), lines
    else:  # ours: one line
        assert len(lines) == 1 and re.search(case.expect, lines[0]), lines


def test_stage_refuses_a_damaged_artifact_from_a_shell_and_commits_nothing(world):
    """The real command, as a user types it: exit 1, the file named in one line, no traceback, and
    no manifest in the bucket (nothing a later fetch could take for whole)."""
    from pipeline.core import storage
    from pipeline.core.specs import load_spec

    shell = [str(Path(sys.executable).parent / "model-release"), "stage", str(world["tiny"])]
    done = subprocess.run(
        [*shell, "--artifact", str(world["flipped"])], capture_output=True, text=True, cwd=PROJECT_ROOT
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "flipped/model.safetensors: sha256 does not match" in done.stderr.splitlines()[-1]
    target = load_spec(world["tiny"]).spec.staging.s3
    assert storage.fetch_manifest_or_none(storage.s3_client(target), target.bucket, f"{target.prefix}/flipped") is None


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    """Only ReleaseError (a user's mistake) becomes one line; a bug propagates with its traceback."""

    def bug(args):
        raise KeyError("a bug")

    parser = cli.parser()
    monkeypatch.setattr(cli, "parser", lambda: parser)
    parser.set_defaults()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.choices["validate"].set_defaults(func=bug)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["validate", str(PROD_SPEC)])
