"""What a reviewer and an SRE read, held byte for byte: the release report and `releases show`,
rendered from a committed registry fixture (tests/golden/registry.json), against the committed
output beside it. A change to either is a change to what people read: regenerate the goldens with
`MODEL_RELEASE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py` and review the diff.

What varies between runs is masked before the comparison: the times the replay records (now), the
temporary directory, the checkout's path, and the images (matplotlib's bytes vary by version; the report's image tests
check them)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from pipeline.core.paths import PROJECT_ROOT
from pipeline.core.specs import load_spec
from pipeline.records.benchmark import BenchmarkFile
from pipeline.records.events import detail_of
from pipeline.release import registry, report
from pipeline.release.registry import Registry, ReleaseData
from tests.conftest import TINY_SPEC

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MODEL_RELEASE_UPDATE_GOLDEN") == "1"


def replayed(tmp_path: Path) -> tuple[Registry, list[int], BenchmarkFile]:
    """The fixture's releases, their events recorded in order into an empty registry."""
    fixture = json.loads((GOLDEN / "registry.json").read_text())
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    loaded = load_spec(TINY_SPEC)
    ids = []
    for release in fixture["releases"]:
        rel = reg.open_release(
            release["run"], loaded.spec.name, "configs/releases/tiny-qwen3-moe-cpu.yaml", "", "local"
        )
        for ev in release["events"]:
            reg.record(
                rel.id,
                detail_of(ev["kind"], ev.get("detail")),
                ev["actor"],
                status=ev.get("status"),
                data=ReleaseData.model_validate(ev["data"]) if ev.get("data") else None,
            )
        ids.append(rel.id)
    return reg, ids, BenchmarkFile.model_validate(fixture["benchmark"])


def masked(text: str, tmp_path: Path) -> str:
    text = text.replace(str(tmp_path), "<tmp>").replace(str(PROJECT_ROOT), "<project>")
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:image/png;base64,<png>", text)
    return re.sub(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:\d\d| UTC)?", "<time>", text)


def same_as_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
        pytest.skip(f"wrote {path}")
    assert path.exists(), f"{path} missing: MODEL_RELEASE_UPDATE_GOLDEN=1 writes it"
    golden = path.read_text()
    if text != golden:
        pairs = zip(golden.splitlines(), text.splitlines(), strict=False)  # a length change: after the common part
        lines = [(i, a, b) for i, (a, b) in enumerate(pairs, 1) if a != b]
        first = lines[0] if lines else (None, "(length differs)", "")
        pytest.fail(f"{name} differs from its golden at line {first[0]}:\n- {first[1][:300]}\n+ {first[2][:300]}")


def test_releases_show_prints_the_golden_audit_trail(tmp_path):
    reg, ids, _ = replayed(tmp_path)
    shown = "\n\n".join(registry.audit_trail(reg, release_id) for release_id in ids) + "\n"
    same_as_golden("releases_show.txt", masked(shown, tmp_path))


def test_the_report_renders_the_golden_page(tmp_path):
    reg, ids, bench = replayed(tmp_path)
    page = report.render(reg, reg.get(ids[-1]), load_spec(TINY_SPEC), bench, None)
    # one element per line: a diff names the part that moved (the template's own line breaks
    # between tags are layout, not content)
    page = re.sub(r">\n\s*<", "><", page)
    same_as_golden("report.html", masked(page.replace("><", ">\n<"), tmp_path) + "\n")


def test_the_report_escapes_what_it_shows(tmp_path):
    """Autoescape: a value from a spec, a registry event or an engine log is text on the page, never
    markup: a layout named `<script>` shows as that text, and no script element appears."""
    reg, ids, bench = replayed(tmp_path)
    bench.layouts[0].layout = "<script>alert(1)</script>"
    bench.layouts[0].stop_reason = "a 'quoted' & <b>bold</b> reason"
    reg.record(ids[-1], detail_of("approved", {"comment": "<script>x</script>"}), "<img src=x onerror=alert(1)>")
    page = report.render(reg, reg.get(ids[-1]), load_spec(TINY_SPEC), bench, None)
    assert "<script>" not in page and "<img src=x" not in page and "<b>bold</b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "a &#39;quoted&#39; &amp; &lt;b&gt;bold&lt;/b&gt; reason" in page


def test_a_damaged_benchmark_file_is_refused_naming_it_and_no_page_is_written(tmp_path):
    """The report reads benchmark.json as its record: a file that is not one (a field lost) fails
    naming the file and the field, and leaves no half-rendered page a reviewer could open."""
    from pipeline.core.errors import ReleaseError

    reg, ids, bench = replayed(tmp_path)
    run = tmp_path / "run"
    (run / "benchmark").mkdir(parents=True)
    data = json.loads(bench.model_dump_json())
    del data["layouts"][0]["tp"]
    (run / "benchmark" / "benchmark.json").write_text(json.dumps(data))
    with pytest.raises(ReleaseError, match=r"benchmark\.json: not a BenchmarkFile: layouts\.0\.tp: Field required"):
        report.write(reg, reg.get(ids[-1]), load_spec(TINY_SPEC), run)
    assert not (run / "report.html").exists()
