"""The docs cannot drift: the generated references match the code (spec models, CLI parser), the
measurements page and the README's demo block match the latest results records, every repository
path the docs name exists, and the site builds with `mkdocs build --strict` (links and anchors)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "scripts" / "docs_gen.py")
assert _spec and _spec.loader
docs_gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_gen)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FIX = "stale: run `make docs` (scripts/docs_gen.py) and commit what it writes"


def _fresh(path: Path, text: str) -> None:
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `make docs`"
    assert path.read_text() == text, f"{path.relative_to(ROOT)} is {FIX}"


def test_the_spec_reference_is_generated_from_the_spec_models() -> None:
    _fresh(ROOT / "docs/reference/spec.md", docs_gen.spec_reference())


def test_the_cli_reference_is_generated_from_the_parser() -> None:
    _fresh(ROOT / "docs/reference/cli.md", docs_gen.cli_reference())


def test_the_measurements_page_renders_the_latest_records() -> None:
    _fresh(ROOT / "docs/measurements.md", docs_gen.measurements_page())


def test_the_readme_demo_block_is_the_latest_demo_record() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme == docs_gen.readme_with_demo_block(readme, docs_gen.demo_block()), f"README.md's demo block is {FIX}"


def test_the_readme_is_a_short_guide() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; the detail belongs in docs/ (at most 250)"


# ---- every repository path the docs name exists ------------------------------------------------

_FILES = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
).stdout.split()
_KNOWN = set(_FILES) | {str(p) for f in _FILES for p in Path(f).parents if str(p) != "."}
_TOP = {f.split("/")[0] for f in _FILES}
_PACKAGES = {f.split("/")[1] for f in _FILES if f.startswith("pipeline/") and f.count("/") >= 2}
_BASENAMES = {Path(f).name for f in _FILES}
_BARE = (".py", ".yaml", ".yml", ".sh", ".md", ".toml", ".Dockerfile", ".in", ".lock")
_SPANS = re.compile(r"```.*?```|`[^`\n]+`", re.S)
_LINKS = re.compile(r"\]\(([^)\s]+)\)")
_NOT_A_PATH = re.compile(r"[<>*{}$…]|\.\.\.|://|^[-~.]")
# files the docs name that live elsewhere, not in this repository
_ELSEWHERE = {"k8s-ds-amdgpu-dp.yaml": "the ROCm device plugin's manifest (github.com/ROCm/k8s-device-plugin)"}


def named_paths(text: str) -> list[tuple[str, bool]]:
    """(path, is_link) for every repository-looking path in code spans, code blocks and links."""
    out = []
    for span in _SPANS.findall(text):
        block = span.startswith("```")  # a command's output or a file the reader writes: only paths with a folder
        for token in re.split(r"[\s=,;()\[\]'\"]+", span.strip("`")):
            token = token.split("::")[0].rstrip(".:")
            if not token or _NOT_A_PATH.search(token) or token in _ELSEWHERE:
                continue
            first = token.split("/")[0]
            if "/" in token and (first in _TOP or first in _PACKAGES):
                out.append((token, False))
            elif "/" not in token and not block and (token in _TOP and "." in token or token.endswith(_BARE)):
                out.append((token, False))
    for target in _LINKS.findall(text):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            out.append((target, True))
    return out


def missing_paths(doc: Path, text: str) -> list[str]:
    missing = []
    for path, is_link in named_paths(text):
        if is_link:
            ok = (doc.parent / path).resolve().exists()
        elif "/" in path:
            # a folder, a file, or a module (`stages/benchmark`) and maybe a name in it (`k8s/pods.base_uri`)
            rel = path.rstrip("/")
            module = rel.rsplit(".", 1)[0] + ".py" if "." in rel.split("/")[-1] else rel + ".py"
            ok = any(c in _KNOWN for r in (rel, module) for c in (r, f"pipeline/{r}"))
        else:
            ok = path in _BASENAMES
        if not ok:
            missing.append(path)
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    assert missing_paths(doc, doc.read_text()) == [], f"{doc.relative_to(ROOT)} names paths that do not exist"


def test_the_path_check_sees_a_missing_path() -> None:
    text = "See `pipeline/core/nope.py`, `core/errors.py`, `nope_stage.py`, `runs/<run>/x.json` and [x](missing.md)."
    assert missing_paths(ROOT / "docs/index.md", text) == ["pipeline/core/nope.py", "nope_stage.py", "missing.md"]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """Strict: a link to a missing page or anchor, or a page left out of the nav, fails the build."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_demo_record_renders_on_the_page_and_in_the_readme(tmp_path: Path) -> None:
    """What `make demo` records (demo.figures over a release's registry data) is what the README shows."""
    from pipeline.core import measurements
    from pipeline.core.specs import load_spec
    from pipeline.embedded import demo
    from pipeline.records.evaluate import GateDecision, TaskVerdict
    from pipeline.records.plan import LayoutPrediction, PredictionCheck
    from pipeline.records.selection import ChosenFigures
    from pipeline.release.registry import ReleaseData

    def checked(layout: str, predicted: float, measured: float | None) -> PredictionCheck:
        prediction = LayoutPrediction(
            layout=layout, predicted_max_slo_rate=predicted, planner_rate=predicted, predicted_per_server=predicted,
            binding_slo="p90 TTFT", bound="compute", calibrated=False, calibration_key="k",
        )  # fmt: skip
        return PredictionCheck(layout=layout, prediction=prediction, max_slo_rate=measured)

    loaded = load_spec(ROOT / "configs/releases/tiny-qwen3-moe-cpu.yaml")
    verdict = TaskVerdict(
        task="tiny_add", metric="acc", baseline=1.0, baseline_stderr=None, candidate=0.995, candidate_stderr=None,
        recovery=0.995, recovery_stderr=None, min_recovery=0.9, floor=0.5, samples_baseline=200,
        samples_candidate=200, expected_samples=200, passed=True, reason="",
    )  # fmt: skip
    data = ReleaseData(
        accuracy=GateDecision(passed=True, tasks=[verdict], failures=[]),
        predictions=[checked("single", 416.0, 340.6), checked("two-replicas", 226.0, None)],
        chosen=ChosenFigures(
            layout="single", rate_per_server=340.6, per_device=340.6, max_slo_rate=340.6, p90_ttft_ms=212.0,
            p90_tpot_ms=9.5, load_seconds=[31.0],
        ),
    )  # fmt: skip
    figures = demo.figures(data, loaded, "success", {"trigger_to_approval_request": 5.66}, "46")
    path = measurements.record("demo", figures, summary="release 1: live, layout single", root=tmp_path)
    assert path.parent == tmp_path / "demo" and path.name.endswith(f"-{measurements.commit()}.json")

    block = docs_gen.demo_block(tmp_path)
    assert "| single | 416 | 340.6 | -18.1% |" in block
    assert "| two-replicas | 226 | — | — |" in block
    assert "tiny_add 1 → 0.995" in block and "`single` at 340.6 req/s per server" in block
    assert 'answered "46"' in block and "5.7 min" in block
    page = docs_gen.measurements_page(tmp_path)
    assert "## demo" in page and "| `chosen.rate_per_server` | 340.6 |" in page
    assert "| `minutes.trigger_to_approval_request` | 5.7 |" in page


def test_the_demo_record_keeps_each_layouts_confirmation_runs(tmp_path: Path, monkeypatch) -> None:
    """#61's must-show lives in the demo's record: each layout's confirmation runs (rate, length,
    p90s, verdict) from the run's benchmark.json, and the minutes they added; the search's probes not."""
    from pipeline.core.paths import run_dir
    from pipeline.embedded import demo
    from pipeline.records.benchmark import LayoutResult, Probe

    monkeypatch.setenv("MODEL_RELEASE_HOME", str(tmp_path))
    assert demo.confirmations("manual__never-ran") == {}

    def probe(rate: float, seconds: float, p90: float, confirmation: bool, passed: bool) -> Probe:
        return Probe(
            rate=rate, num_prompts=round(rate * seconds), achieved_rate=rate, completed=round(rate * seconds),
            failed=0, failed_fraction=0.0, duration_s=seconds, output_tok_s=0.0, p50_ttft_ms=p90 / 2,
            p90_ttft_ms=p90, p99_ttft_ms=p90 * 1.5, p50_tpot_ms=5, p90_tpot_ms=9, p99_tpot_ms=12, p90_itl_ms=9,
            p90_e2el_ms=200, confirmation=confirmation, passed=passed,
        )  # fmt: skip

    def layout(name: str, probes: list[Probe], **confirmed) -> dict:
        result = LayoutResult(
            layout=name, tp=1, dp=1, ep=1, pp=1, replicas=1, devices=1, status="ok", probes=probes, **confirmed
        )
        return json.loads(result.model_dump_json())

    out = run_dir("manual__r1") / "benchmark"
    out.mkdir(parents=True)
    layouts = [
        layout("single", [probe(200, 8, 300, False, True), probe(210, 12.5, 620, True, False),
                          probe(199.5, 12.0, 410.04, True, True)]),
        layout("two-replicas", [probe(150, 8, 200, False, True), probe(150, 11.5, 180, True, True)],
               confirm_engine="fresh", confirm_wall_s=41.5),
    ]  # fmt: skip
    (out / "benchmark.json").write_text(json.dumps({"layouts": layouts}))
    seen = demo.confirmations("manual__r1")
    assert [r["rate"] for r in seen["layouts"]["single"]] == [210, 199.5]
    assert [r["passed"] for r in seen["layouts"]["single"]] == [False, True]
    assert seen["layouts"]["single"][1] == {
        "rate": 199.5, "requests": 2394, "seconds": 12.0, "p90_ttft_ms": 410.0, "p90_tpot_ms": 9, "passed": True,
    }  # fmt: skip
    # a fresh engine's confirmation adds its start too (the record's wall time); one without it, its runs
    assert seen["minutes_added"] == round((12.5 + 12.0 + 41.5) / 60, 2)
    assert seen["engines"] == {"single": None, "two-replicas": "fresh"}


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@example.com"], ["config", "user.name", "t"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    (repo / "code.py").write_text("RATE = 1\n")
    subprocess.run(["git", "add", "code.py"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "one"], cwd=repo, check=True)
    return repo


def test_a_record_from_a_dirty_tree_keeps_its_diff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its commit alone does not pin the code that measured it: the diff goes beside it, or no record."""
    from pipeline.core import measurements

    repo = _repo(tmp_path)
    clean = measurements.record("x", {"a": 1}, root=tmp_path / "results", repo=repo)
    assert not clean.name.endswith("-dirty.json") and not list(clean.parent.glob("*.diff"))
    assert measurements.Measurement.model_validate_json(clean.read_text()).diff is None

    (repo / "code.py").write_text("RATE = 2\n")
    dirty = measurements.record("x", {"a": 2}, root=tmp_path / "results", repo=repo)
    rec = measurements.Measurement.model_validate_json(dirty.read_text())
    assert rec.commit.endswith("-dirty") and rec.diff == dirty.with_suffix(".diff").name
    patch = (dirty.parent / rec.diff).read_bytes()
    assert b"-RATE = 1" in patch and b"+RATE = 2" in patch
    # the diff applies to the record's commit and gives back the measured code
    subprocess.run(["git", "stash", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "apply", str(dirty.parent / rec.diff)], cwd=repo, check=True)
    assert (repo / "code.py").read_text() == "RATE = 2\n"

    # a diff that cannot be taken: refused, and nothing written
    real = measurements._git_bytes
    monkeypatch.setattr(measurements, "_git_bytes", lambda r, *a: None if a[:1] == ("diff",) else real(r, *a))
    before = sorted(p.name for p in (tmp_path / "results/x").iterdir())
    (repo / "code.py").write_text("RATE = 3\n")
    with pytest.raises(measurements.MeasurementError, match="uncommitted changes"):
        measurements.record("x", {"a": 3}, root=tmp_path / "results", repo=repo)
    assert sorted(p.name for p in (tmp_path / "results/x").iterdir()) == before


def test_the_page_says_which_records_do_not_pin_their_code(tmp_path: Path) -> None:
    """A record from a dirty tree written before diffs were kept is flagged; one with its diff links it."""
    from pipeline.core import measurements

    base = {"date": "2026-12-05T00:00:00+00:00", "command": "x", "machine": {}, "figures": {"a": 1}}
    (tmp_path / "old").mkdir()
    (tmp_path / "old/2026-12-05-abc1234-dirty.json").write_text(
        measurements.Measurement(name="old", commit="abc1234-dirty", **base).model_dump_json()
    )
    (tmp_path / "new").mkdir()
    (tmp_path / "new/2026-12-05-abc1234-dirty.diff").write_text("diff --git a/x b/x\n")
    (tmp_path / "new/2026-12-05-abc1234-dirty.json").write_text(
        measurements.Measurement(
            name="new", commit="abc1234-dirty", diff="2026-12-05-abc1234-dirty.diff", **base
        ).model_dump_json()
    )
    page = docs_gen.measurements_page(tmp_path)
    new, old = page.split("## new")[1].split("## old")
    assert "diff not kept" in old and "diff not kept" not in new
    assert "benchmarks/results/new/2026-12-05-abc1234-dirty.diff" in new


def test_every_committed_record_with_a_diff_has_it() -> None:
    from pipeline.core import measurements

    for path in sorted(measurements.RESULTS_DIR.glob("*/*.json")):
        rec = measurements.Measurement.model_validate_json(path.read_text())
        assert rec.diff is None or (path.parent / rec.diff).is_file(), f"{path}: its diff {rec.diff} is missing"


def test_every_measurement_has_a_guide() -> None:
    """The page is a guide: each record name says what it measures and concludes (benchmarks/guides/)."""
    from pipeline.core import measurements

    missing = [name for name in measurements.latest() if not (docs_gen.GUIDES / f"{name}.md").is_file()]
    assert missing == [], f"records without a guide in benchmarks/guides/: {missing}"
    for path in sorted(docs_gen.GUIDES.glob("*.md")):
        text = path.read_text()
        assert "**What it measures.**" in text and "**Conclusion.**" in text, path


def test_a_conclusion_drawn_from_an_older_record_says_so(tmp_path: Path) -> None:
    from pipeline.core import measurements

    base = {"command": "x", "commit": "abc1234", "machine": {}, "figures": {"rate": 1}}
    (tmp_path / "results/speed").mkdir(parents=True)
    for day in ("05", "06"):
        rec = measurements.Measurement(name="speed", date=f"2026-12-{day}T00:00:00+00:00", **base)
        (tmp_path / f"results/speed/2026-12-{day}-abc1234.json").write_text(rec.model_dump_json())
    guides = tmp_path / "guides"
    guides.mkdir()
    text = "**What it measures.** Speed.\n\n**Conclusion.** Fast enough. Details follow.\n"
    (guides / "speed.md").write_text("<!-- conclusion drawn from: speed/2026-12-06-abc1234.json -->\n" + text)
    page = docs_gen.measurements_page(tmp_path / "results", guides)
    assert "| [speed](#speed) | Fast enough. |" in page and "newest record is" not in page
    (guides / "speed.md").write_text("<!-- conclusion drawn from: speed/2026-12-05-abc1234.json -->\n" + text)
    page = docs_gen.measurements_page(tmp_path / "results", guides)
    assert "drawn from `speed/2026-12-05-abc1234.json`; the newest record is `speed/2026-12-06-abc1234.json`" in page
    (guides / "speed.md").unlink()
    assert "No guide yet" in docs_gen.measurements_page(tmp_path / "results", guides)
