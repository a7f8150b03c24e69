"""The registry as a system of record, on both engines it runs on: SQLite (the embedded default)
and a real PostgreSQL started by the suite (production's engine, `postgres` in conftest.py).

Each test gets a fresh database: on Postgres the owner role migrates it and the test reads and
writes as the runtime role, as production does; on SQLite one URL is both."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy
from pydantic import ValidationError

from pipeline.core.errors import NotMigrated
from pipeline.core.paths import PROJECT_ROOT
from pipeline.records.events import detail_of
from pipeline.records.selection import ChosenFigures
from pipeline.release import migrations
from pipeline.release.registry import STATUSES, Registry, ReleaseData, with_driver
from tests.test_golden import GOLDEN, same_as_golden

DEMO_DB = PROJECT_ROOT.parent / "shared" / "fixtures" / "registry-1b3a689-demo.db"  # read-only: copied first


def chosen(layout: str = "single", **figures) -> ChosenFigures:
    """A chosen layout's figures, those not given None (what tests record at an SLO gate)."""
    unset = {k: None for k, f in ChosenFigures.model_fields.items() if f.is_required()}
    return ChosenFigures.model_validate({**unset, "layout": layout, **figures})


class Urls:
    """Where a test's registry is: `owner` migrates, `app` is what the pipeline runs as."""

    def __init__(self, owner: str, app: str, engine: str):
        self.owner, self.app, self.engine = owner, app, engine


@pytest.fixture(params=["sqlite", "postgres"])
def urls(request, tmp_path) -> Urls:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'registry.db'}"
        return Urls(url, url, "sqlite")
    from tests.postgres import APP, OWNER

    server = request.getfixturevalue("postgres")
    database = server.database()
    return Urls(server.url(OWNER, database), server.url(APP, database), "postgres")


@pytest.fixture
def reg(urls) -> Registry:
    """Migrated by the owner (on Postgres), opened as the runtime role: what a task holds."""
    Registry(urls.owner).engine.dispose()
    return Registry(urls.app)


def refused(reg: Registry, statement: str) -> str:
    """Run one statement on the registry's own connection; the database's error line, or fail."""
    with pytest.raises(sqlalchemy.exc.DBAPIError) as err:
        with reg.engine.begin() as conn:
            conn.exec_driver_sql(statement)
    return str(err.value.orig).splitlines()[0]


def test_open_release_is_idempotent_per_run(reg):
    first = reg.open_release("run-a", "x", "x.yaml", "", "local")
    again = reg.open_release("run-a", "x", "x.yaml", "", "local")
    other = reg.open_release("run-b", "x", "x.yaml", "", "local")
    assert first.id == again.id != other.id
    assert [e.kind for e in reg.events(first.id)] == ["created"]


def test_the_registry_refuses_data_outside_its_schema(reg):
    rel = reg.open_release("run-s", "x", "x.yaml", "", "local")
    # what a step writes is a ReleaseData: a misspelt fact or a wrong type is refused, named, before any write
    with pytest.raises(ValidationError, match=r"ReleaseData\nartifact_url\n  Extra inputs are not permitted"):
        reg.record(rel.id, detail_of("staged", None), "pipeline", data=ReleaseData(artifact_url="s3://b/k"))  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match=r"ReleaseData\nchosen.rate_per_server\n  Input should be a valid number"):
        reg.record(
            rel.id,
            detail_of("slo_gate", None),
            "gate",
            data=ReleaseData(chosen={"layout": "x", "rate_per_server": "fast"}),
        )  # type: ignore[arg-type]
    assert reg.get(rel.id).data == ReleaseData() and [e.kind for e in reg.events(rel.id)] == ["created"]
    reg.record(
        rel.id, detail_of("slo_gate", None), "gate", data=ReleaseData(chosen=chosen("single", rate_per_server=12.5))
    )
    reg.record(
        rel.id, detail_of("staged", None), "pipeline", data=ReleaseData(s3_uri="s3://b/k")
    )  # merged, not replaced
    data = reg.get(rel.id).data
    assert data.chosen and data.chosen.rate_per_server == 12.5 and data.s3_uri == "s3://b/k"


def test_a_release_keeps_its_inputs_and_they_never_change(urls, reg):
    """Spec text, hardware profile and resolved model source, read back typed with the release;
    refused changing at the database (every role) like the events."""
    from pipeline.records.release import ReleaseInputs

    kept = ReleaseInputs(hardware_path="/cfg/hardware/h.yaml", hardware_yaml="name: h\n", model_source="/models/m")
    rel = reg.open_release("run-i", "x", "/cfg/releases/x.yaml", "name: x\n", "local", kept)
    again = reg.open_release("run-i", "x", "/cfg/releases/x.yaml", "other", "local", None)  # a retry changes nothing
    assert rel.inputs == kept and again.inputs == kept and reg.get(rel.id).spec_yaml == "name: x\n"
    assert reg.open_release("run-j", "x", "x.yaml", "", "local").inputs is None
    owner = Registry(urls.owner)
    for statement in ("UPDATE release_inputs SET hardware_yaml = 'name: other'", "DELETE FROM release_inputs"):
        assert "release_inputs is append-only" in refused(owner, statement)
    assert reg.get(rel.id).inputs == kept


def test_a_status_change_is_conditional_and_always_leaves_its_event(reg):
    rel = reg.open_release("run-c", "x", "x.yaml", "", "local")
    moved = reg.record(rel.id, detail_of("approved", None), "reviewer", status="approved", only_from=("candidate",))
    late = reg.record(
        rel.id, detail_of("slo_gate", {"passed": True}), "gate", status="candidate", only_from=("candidate",)
    )
    assert moved.status_after == "approved" and late.status_after is None  # the late verdict revives nothing
    assert reg.get(rel.id).status == "approved"
    assert [(e.kind, e.status_after) for e in reg.events(rel.id)][1:] == [("approved", "approved"), ("slo_gate", None)]
    with pytest.raises(ValueError, match="status 'aproved': expected one of candidate"):
        reg.record(rel.id, detail_of("approved", None), "reviewer", status="aproved")
    assert "live" in STATUSES


def test_the_event_log_is_append_only_in_the_database(urls, reg):
    """For every role: SQLite's triggers; Postgres' trigger, which refuses the owner too."""
    rel = reg.open_release("run-e", "x", "x.yaml", "", "local")
    reg.record(rel.id, detail_of("approved", {"comment": "ok"}), "reviewer", status="approved")
    owner = Registry(urls.owner)
    statements = ["UPDATE release_events SET actor = 'someone-else'", "DELETE FROM release_events"]
    if urls.engine == "postgres":
        statements.append("TRUNCATE release_events CASCADE")
    for statement in statements:
        assert "release_events is append-only" in refused(owner, statement)
    assert [(e.kind, e.actor) for e in reg.events(rel.id)] == [("created", "pipeline"), ("approved", "reviewer")]


def test_the_runtime_role_cannot_change_or_unguard_the_event_log_on_postgres(postgres):
    """Privileges first: the role the pipeline runs as may read, append and move a release's status,
    and the database refuses it anything else, the guard's removal included."""
    from tests.postgres import APP, OWNER

    database = postgres.database()
    Registry(postgres.url(OWNER, database)).engine.dispose()
    app = Registry(postgres.url(APP, database))
    rel = app.open_release("run-p", "x", "x.yaml", "spec: 1", "local")
    app.record(
        rel.id, detail_of("approved", None), "reviewer", status="approved", data=ReleaseData(chosen=chosen("single"))
    )
    lines = {
        statement: refused(app, statement)
        for statement in (
            "UPDATE release_events SET actor = 'someone-else'",
            "DELETE FROM release_events",
            "TRUNCATE release_events",
            "DROP TRIGGER release_events_no_change ON release_events",
            "DROP FUNCTION release_events_append_only() CASCADE",
            "ALTER TABLE release_events DISABLE TRIGGER ALL",
            "UPDATE releases SET spec_yaml = 'spec: 2'",
            "UPDATE release_inputs SET model_source = 'elsewhere'",
            "DELETE FROM releases",
        )
    }
    for statement, line in lines.items():
        assert "permission denied" in line or "must be owner" in line, (statement, line)
    assert (
        lines["DROP TRIGGER release_events_no_change ON release_events"] == "must be owner of relation release_events"
    )
    assert lines["TRUNCATE release_events"] == "permission denied for table release_events"
    got = app.get(rel.id)
    assert (got.status, got.spec_yaml, got.data.layout) == ("approved", "spec: 1", "single")
    assert [e.kind for e in app.events(rel.id)] == ["created", "approved"]


def _racer(url: str, release_ids: list[int], barrier, results, who: str) -> None:
    """One process of the race: per release, wait for the other, then try to approve it."""
    reg = Registry(url)
    for rid in release_ids:
        barrier.wait(timeout=120)
        ev = reg.record(rid, detail_of("approved", {"comment": who}), who, status="approved", only_from=("candidate",))
        results.put((rid, who, ev.status_after))


def test_two_processes_racing_one_status_change_exactly_one_wins(urls, reg):
    ids = [reg.open_release(f"run-race-{i}", "x", "x.yaml", "", "local").id for i in range(8)]
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no engine or lock inherited
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(urls.app, ids, barrier, results, who)) for who in ("p1", "p2")]
    for p in procs:
        p.start()
    got = [results.get(timeout=180) for _ in range(2 * len(ids))]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rid in ids:
        outcomes = sorted((status or "-") for r, _, status in got if r == rid)
        assert outcomes == ["-", "approved"], (rid, outcomes)  # exactly one moved it; both events kept
        events = [e for e in reg.events(rid) if e.kind == "approved"]
        assert len(events) == 2 and sum(e.status_after == "approved" for e in events) == 1
        assert reg.get(rid).status == "approved"


def test_a_postgres_url_goes_through_the_locked_driver():
    assert with_driver("postgres://app:pw@db/model_release") == "postgresql+psycopg://app:pw@db/model_release"
    assert with_driver("postgresql+psycopg2://a:b@h:5433/r?sslmode=require").startswith(
        "postgresql+psycopg://a:b@h:5433"
    )
    assert with_driver("sqlite:////x/registry.db") == "sqlite:////x/registry.db"


def test_the_url_comes_from_the_airflow_connection_without_an_override(monkeypatch):
    from pipeline.core import platform
    from pipeline.core.platform import Connection
    from pipeline.release import registry

    class Kept:
        def connection(self, conn_id):
            assert conn_id == "model_release_registry"
            return Connection(conn_id=conn_id, uri="postgres://app:pw@db/model_release")

    monkeypatch.delenv("MODEL_RELEASE_REGISTRY_URL", raising=False)
    monkeypatch.setattr(platform, "current", lambda: Kept())
    registry._connection_url.cache_clear()
    assert registry.registry_url() == "postgresql+psycopg://app:pw@db/model_release"
    monkeypatch.setenv("MODEL_RELEASE_REGISTRY_URL", "sqlite:////x/r.db")
    assert registry.registry_url() == "sqlite:////x/r.db"
    registry._connection_url.cache_clear()  # no other test sees the kept connection


# --- migrations ---------------------------------------------------------------------------------


def baseline_from_golden_fixture(url: str) -> None:
    """tests/golden/registry.json written as a database at the baseline revision would hold it
    (rows inserted directly: today's code writes only at head), at fixed times."""
    engine = sqlalchemy.create_engine(url)
    migrations.upgrade(engine, url, to=migrations.BASELINE)
    meta = sqlalchemy.MetaData()
    meta.reflect(engine, only=["releases", "release_events"])
    releases, events = meta.tables["releases"], meta.tables["release_events"]
    at = datetime(2026, 12, 1, tzinfo=UTC)
    with engine.begin() as conn:
        for n, release in enumerate(json.loads((GOLDEN / "registry.json").read_text())["releases"], 1):
            spec = "configs/releases/tiny-qwen3-moe-cpu.yaml"
            rows = [
                {"kind": "created", "actor": "pipeline", "status": "candidate", "detail": {"run_key": release["run"]}}
            ]
            status, data = "candidate", {}
            for ev in [*rows, *release["events"]]:
                status = ev.get("status") or status
                data |= ReleaseData.model_validate(ev.get("data") or {}).model_dump(mode="json", exclude_unset=True)
            conn.execute(
                releases.insert().values(
                    id=n, run_key=release["run"], name="tiny-qwen3-moe-fp8", spec_path=spec, spec_yaml="",
                    target="local", status=status, data=data, created_at=at, updated_at=at,
                )
            )  # fmt: skip
            for ev in [*rows, *release["events"]]:
                at += timedelta(minutes=1)
                conn.execute(
                    events.insert().values(
                        release_id=n, at=at, kind=ev["kind"], actor=ev["actor"], status_after=ev.get("status"),
                        detail=ev.get("detail") or {},
                    )
                )  # fmt: skip
    engine.dispose()


def read_back(reg: Registry) -> list[dict]:
    """Every release and event, through the typed records; a fact this code does not know fails."""
    out = []
    for rel in sorted(reg.releases(), key=lambda r: r.id):
        out.append(
            {
                "release": rel.model_dump(mode="json", exclude={"data"}),
                "facts": rel.data.model_dump(mode="json", exclude_none=True),
                "events": [e.model_dump(mode="json") for e in reg.events(rel.id)],
            }
        )
    return out


def test_the_demo_registry_written_at_1b3a689_upgrades_to_head_and_reads_typed(tmp_path):
    if not DEMO_DB.exists():
        pytest.fail(f"{DEMO_DB}: the shared fixture is missing (a CI run has it at ../shared/fixtures/)")
    db = tmp_path / "registry.db"
    shutil.copyfile(DEMO_DB, db)  # never written in place: the fixture is read-only
    reg = Registry(f"sqlite:///{db}")
    with reg.engine.connect() as conn:
        assert migrations.revision(conn) == migrations.head()
    trail = read_back(reg)
    assert len(trail) == 1 and len(trail[0]["events"]) == 18
    # the guard survives the upgrade
    assert "append-only" in refused(reg, "DELETE FROM release_events")
    same_as_golden("migrated-1b3a689-demo.json", json.dumps(trail, indent=1) + "\n")


def test_the_golden_registry_at_the_baseline_upgrades_to_head_and_reads_typed(urls):
    baseline_from_golden_fixture(urls.owner)
    Registry(urls.owner).engine.dispose()  # the owner's open upgrades it
    reg = Registry(urls.app)
    same_as_golden("migrated-golden-registry.json", json.dumps(read_back(reg), indent=1) + "\n")


def test_facts_kept_under_an_old_name_are_renamed_by_a_migration(urls):
    engine = sqlalchemy.create_engine(urls.owner)
    migrations.upgrade(engine, urls.owner, to="0002")
    at = datetime(2026, 12, 1, tzinfo=UTC)
    with engine.begin() as conn:
        conn.execute(
            sqlalchemy.text(
                "INSERT INTO releases (run_key, name, spec_path, spec_yaml, target, status, data, created_at,"
                " updated_at) VALUES ('r', 'x', 'x.yaml', '', 'local', 'live', :d, :at, :at)"
            ),
            {"d": json.dumps({"artifact_uri": "s3://b/k", "layout": "single"}), "at": at},
        )
    engine.dispose()
    Registry(urls.owner).engine.dispose()
    rel = Registry(urls.app).releases()[0]
    assert rel.data.s3_uri == "s3://b/k" and rel.data.layout == "single"


def test_a_runtime_role_behind_head_is_told_to_run_the_upgrade_step(postgres):
    from tests.postgres import APP

    database = postgres.database()
    with pytest.raises(NotMigrated, match=r"at revision none, this code needs \d+, .*releases migrate"):
        Registry(postgres.url(APP, database))


def test_the_version_table_is_the_registrys_own(tmp_path):
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    tables = sqlalchemy.inspect(reg.engine).get_table_names()
    assert migrations.VERSION_TABLE in tables and "alembic_version" not in tables  # Airflow's name stays Airflow's
