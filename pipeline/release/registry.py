"""Release registry: one row per release candidate and an append-only audit log of events.

Months after a rollout someone asks who approved what, on which evidence: every gate result,
approval, rejection, deploy step, smoke test and rollback is an event row with a timestamp and
an actor, and event rows are never updated or deleted: the API has no such call, and the database
refuses it (SQLite triggers; on Postgres a trigger, and privileges that leave the runtime role only
reading and appending). The schema is migrated (`pipeline.release.migrations`), never created ad hoc.
SQLite file by default; Postgres in production (psycopg, the one driver locked), its URL from the
environment (`MODEL_RELEASE_REGISTRY_URL`) or the Airflow connection `model_release_registry`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, field_serializer, model_validator
from sqlalchemy import JSON, DateTime, ForeignKey, Integer, String, Text, create_engine, event, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship

from pipeline.core import platform
from pipeline.core.errors import ReleaseError, UnknownRelease
from pipeline.core.paths import home
from pipeline.core.rollout import Deployment
from pipeline.core.specs import LoadedSpec, hardware_path, resolved_source
from pipeline.planner.calibration import Measurements, observations
from pipeline.planner.profile import Profile
from pipeline.records import events
from pipeline.records.capacity import CapacityPlan
from pipeline.records.evaluate import EvaluationPair, GateDecision
from pipeline.records.events import Created, EventDetail, EventRecord, UnreadEvent
from pipeline.records.plan import PredictionCheck
from pipeline.records.release import ReleaseInputs, StagedRef
from pipeline.records.selection import ChosenFigures
from pipeline.records.served_accuracy import ServedSummary
from pipeline.release import migrations
from pipeline.stages import capacity

CONN_ID = "model_release_registry"
Status = Literal[
    "candidate",
    "gate_failed",
    "approved",
    "rejected",
    "deploying",
    "live",
    "failed",
    "rolled_back",
    "superseded",
    "degraded",
    "stopped",
]
STATUSES: tuple[str, ...] = get_args(Status)
# Statuses that mean "this release is (or should be) serving".
SERVING = ("live", "degraded")


class Base(DeclarativeBase):
    """The tables as this code reads and writes them; the migrations create and change them."""


class ReleaseRow(Base):
    __tablename__ = "releases"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_key: Mapped[str] = mapped_column(String(250), unique=True, doc="the Airflow run id: one release per run")
    name: Mapped[str] = mapped_column(String(200), index=True)
    spec_path: Mapped[str] = mapped_column(Text)
    spec_yaml: Mapped[str] = mapped_column(Text)
    target: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), index=True)
    data: Mapped[dict] = mapped_column(JSON, default=dict, doc="model/artifact URIs, hashes, layout, summaries")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # its own query (selectin), never a join: Postgres refuses FOR UPDATE beside an outer join
    inputs: Mapped[InputsRow | None] = relationship(lazy="selectin")


class InputsRow(Base):
    """What a release was built from besides its spec text (records.release.ReleaseInputs); never changed."""

    __tablename__ = "release_inputs"

    release_id: Mapped[int] = mapped_column(ForeignKey("releases.id"), primary_key=True)
    hardware_path: Mapped[str] = mapped_column(Text)
    hardware_yaml: Mapped[str] = mapped_column(Text)
    model_source: Mapped[str] = mapped_column(Text)


class EventRow(Base):
    __tablename__ = "release_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    release_id: Mapped[int] = mapped_column(ForeignKey("releases.id"), index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    kind: Mapped[str] = mapped_column(String(50))
    actor: Mapped[str] = mapped_column(String(200))
    status_after: Mapped[str | None] = mapped_column(String(20), nullable=True)
    detail: Mapped[dict] = mapped_column(JSON, default=dict)


class ProfileRow(Base):
    """A profiling run's fitted step-time coefficients (planner/profile.py), per hardware and engine image."""

    __tablename__ = "planner_profiles"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hardware: Mapped[str] = mapped_column(String(200), index=True)
    engine_image: Mapped[str] = mapped_column(String(500))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    data: Mapped[dict] = mapped_column(JSON, doc="the Profile")


# A Kubernetes object as the API takes it (Kubernetes' own schema, not ours): JSON, typed as JSON.
KubeObject = dict[str, JsonValue]


class ReleaseData(BaseModel):
    """What the registry keeps about a release (its `data`): one name per fact, each written by one step,
    a step's record nested whole (the chosen layout's figures are a `ChosenFigures`, not copies of its fields).

    `Registry.record` checks every write against this (an unknown or misspelt key, or a wrong type,
    is refused naming it); `Release.data` reads it typed. Releases stored before the figures were
    nested keep them flat at the top level: `_nest_flat_figures` reads them into `chosen`.
    """

    model_config = ConfigDict(extra="forbid")

    # stage: where the weights are, by manifest hash (what promotion re-verifies and deploys)
    s3_uri: str | None = Field(None, description="the staged FP8 artifact on S3 / Spaces")
    nfs_path: str | None = Field(None, description="the staged FP8 artifact on the NFS share")
    manifest_hash: str | None = Field(None, description="the staged artifact's manifest hash")
    quantized_path: str | None = Field(None, description="the local FP8 output that was staged")
    # accuracy gate
    accuracy: GateDecision | None = Field(None, description="the gate's decision (tasks, recovery, failures)")
    source_hash: str | None = Field(None, description="the source model's manifest hash")
    source_path: str | None = Field(None, description="the source model's directory")
    evaluation: EvaluationPair | None = Field(
        None, description="the gate's in-process results, per item: what served answers are held to"
    )
    # SLO gate: the chosen layout's figures and the fleet
    chosen: ChosenFigures | None = Field(None, description="the chosen layout's figures (the SLO gate's)")
    benchmark_files: dict[str, str] | None = Field(None, description="kind (json, csv, plot, ...) -> file")
    capacity: CapacityPlan | None = Field(None, description="the fleet and its cost at the spec's peak")
    predictions: list[PredictionCheck] | None = Field(
        None, description="per benchmarked layout: the planner's prediction beside the measured max SLO rate"
    )
    served_accuracy: list[ServedSummary] | None = Field(
        None, description="per benchmarked layout: serving-path accuracy passed, seconds, per task served/in-process"
    )
    # report and promotion
    report: str | None = Field(None, description="the reviewer report's path")
    endpoint: str | None = Field(None, description="where the release serves, once live")
    deployment: Deployment | None = Field(None, description="local target: the running instance")
    manifests: list[KubeObject] | None = Field(
        None, description="kubernetes target: the applied objects, as the API takes them (Kubernetes' own schema)"
    )
    manifests_file: str | None = Field(None, description="where those objects were written, as YAML")

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_figures(cls, data: Any) -> Any:
        """A release stored before `chosen` (up to 1b3a689) keeps the figures flat beside the other facts."""
        if not isinstance(data, dict) or "layout" not in data:
            return data
        flat = {k: data[k] for k in ChosenFigures.model_fields if k in data}
        rest = {k: v for k, v in data.items() if k not in flat}
        if rest.get("chosen") is None:  # a nested record, where one was written since, wins
            rest["chosen"] = {k: None for k, f in ChosenFigures.model_fields.items() if f.is_required()} | flat
        return rest

    @property
    def layout(self) -> str | None:
        """The chosen layout's name; None before the SLO gate chose one."""
        return self.chosen.layout if self.chosen else None

    def slowest_load(self) -> float | None:
        """What a scale-out or a rollback waits for: the chosen layout's slowest replica, start to healthy."""
        return max(self.chosen.load_seconds or [] if self.chosen else [], default=None)


# what a page reads where no SLO gate chose a layout yet: every figure None (a layout named "None")
NOTHING_CHOSEN = ChosenFigures(
    layout="None", rate_per_server=None, per_device=None, max_slo_rate=None, p90_ttft_ms=None, p90_tpot_ms=None,
    load_seconds=None,
)  # fmt: skip


def _utc(at: datetime) -> datetime:
    """SQLite hands back the stored UTC time without its zone, Postgres with it: one type on both."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)


UtcTime = Annotated[datetime, AfterValidator(_utc)]


class Release(BaseModel):
    id: int
    run_key: str
    name: str
    spec_path: str
    spec_yaml: str
    target: str
    status: str
    data: ReleaseData = Field(description="its facts, as the steps recorded them")
    created_at: UtcTime
    updated_at: UtcTime
    inputs: ReleaseInputs | None = Field(None, description="None: opened before releases kept their inputs")

    def staged(self) -> StagedRef:
        """Where its weights are staged, by manifest hash: what promotion and a re-benchmark serve."""
        if self.data.manifest_hash is None:
            raise ReleaseError(f"release {self.id}: no staged artifact on record (its stage step never ran)")
        return StagedRef(manifest_hash=self.data.manifest_hash, s3_uri=self.data.s3_uri, nfs_path=self.data.nfs_path)

    def chosen(self) -> ChosenFigures:
        """The chosen layout's figures; a release without them (its SLO gate never chose) is an error here."""
        if self.data.chosen is None:
            raise ReleaseError(f"release {self.id}: no chosen layout on record (its SLO gate never chose one)")
        return self.data.chosen


DetailRecord = TypeVar("DetailRecord", bound=BaseModel)


class Event(BaseModel):
    id: int
    release_id: int
    at: UtcTime
    kind: str
    actor: str
    status_after: str | None
    detail: EventDetail | UnreadEvent = Field(
        description="its evidence, the record of its kind (records.events); UnreadEvent: a stored kind no record reads"
    )

    @classmethod
    def of(cls, row: EventRow) -> Event:
        """A stored row, its detail read as its kind's record (the kind is the row's column, not in its JSON)."""
        return cls(
            id=row.id,
            release_id=row.release_id,
            at=row.at,
            kind=row.kind,
            actor=row.actor,
            status_after=row.status_after,
            detail=events.read(row.kind, row.detail or {}),
        )

    @field_serializer("detail")
    def _as_stored(self, detail: EventDetail | UnreadEvent) -> dict[str, JsonValue]:
        """Dumped as the registry keeps it: the fields its writer set, no `kind` (that is the event's)."""
        return detail.stored()

    def detail_as(self, record: type[DetailRecord]) -> DetailRecord:
        """The detail narrowed to the record its kind writes (or a base of it, e.g. GateVerdict); a
        detail of another record, or one that did not read (UnreadEvent), is an error naming the event."""
        if isinstance(self.detail, record):
            return self.detail
        why = self.detail.problem if isinstance(self.detail, UnreadEvent) else f"a {type(self.detail).__name__}"
        raise ReleaseError(f"release {self.release_id}, event {self.id} ({self.kind}): not a {record.__name__}: {why}")


def _now() -> datetime:
    return datetime.now(UTC)


def registry_url() -> str:
    """The environment first (an explicit override: tests, a pod's Secret), then the Airflow
    connection wherever Airflow keeps it (environment, metadata database, a secrets backend), then
    the SQLite file under MODEL_RELEASE_HOME (the embedded default)."""
    if url := os.environ.get("MODEL_RELEASE_REGISTRY_URL"):
        return with_driver(url)
    return _connection_url() or f"sqlite:///{home() / 'registry.db'}"


@functools.cache
def _connection_url() -> str | None:
    """Asked once per process: `cached()` resolves the URL on every call (a plugin page, a task),
    and each ask is a secrets-backend, API or metadata-database round trip."""
    conn = platform.current().connection(CONN_ID)
    return with_driver(conn.uri.get_secret_value()) if conn else None


def with_driver(url: str) -> str:
    """A Postgres URL through psycopg (v3), the one driver locked: Airflow writes a connection's
    URI as `postgres://`, which SQLAlchemy does not know, and older settings name psycopg2."""
    parsed = make_url(url)
    if parsed.get_backend_name() in ("postgres", "postgresql"):
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return url


class Registry:
    """Typed access to the registry; every status change goes with the event that caused it."""

    def __init__(self, url: str | None = None):
        self.url = url or registry_url()
        self.engine = create_engine(self.url, future=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", lambda conn, _: conn.execute("PRAGMA busy_timeout = 30000"))
        # every open brings the schema to head (a no-op check once there): the embedded default
        # needs no extra command; a runtime role that may not migrate is told to run the step
        self.migrated_from = migrations.upgrade(self.engine, self.safe_url)

    @contextmanager
    def _session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    def open_release(
        self,
        run_key: str,
        name: str,
        spec_path: str,
        spec_yaml: str,
        target: str,
        inputs: ReleaseInputs | None = None,
    ) -> Release:
        """The release of this run; created on first call (task retries find the same row), with
        the `inputs` it is built from (`inputs_of`), in the same transaction."""
        with self._session() as s:
            row = s.scalar(select(ReleaseRow).where(ReleaseRow.run_key == run_key))
            if row is None:
                now = _now()
                row = ReleaseRow(
                    run_key=run_key,
                    name=name,
                    spec_path=spec_path,
                    spec_yaml=spec_yaml,
                    target=target,
                    status="candidate",
                    data={},
                    created_at=now,
                    updated_at=now,
                    inputs=InputsRow(**inputs.model_dump()) if inputs else None,
                )
                s.add(row)
                s.flush()
                s.add(
                    EventRow(
                        release_id=row.id,
                        at=now,
                        kind="created",
                        actor="pipeline",
                        status_after="candidate",
                        detail=Created(run_key=run_key, spec_path=spec_path).stored(),
                    )
                )
            return Release.model_validate(row, from_attributes=True)

    def record(
        self,
        release_id: int,
        detail: EventDetail,
        actor: str,
        *,
        status: str | None = None,
        data: ReleaseData | None = None,
        only_from: tuple[str, ...] | None = None,
    ) -> Event:
        """Append the event `detail`, a record of records.events (its kind is the record's own; a
        field it does not declare was refused when it was made); optionally move the release to
        `status` and merge the facts `data` sets (the fields given, None included) into its record.

        `only_from`: change the status only if the release is (still) in one of these (a verdict
        measured for minutes must not revive a superseded release). The change is one conditional
        UPDATE (`WHERE id = ? AND status IN (...)`, its row count read), never a read then a write:
        of two processes moving the same release, exactly one does; the other's event is recorded
        with no status change (`status_after` None).
        """
        if status is not None and status not in STATUSES:
            raise ValueError(f"status {status!r}: expected one of {', '.join(STATUSES)}")
        if not isinstance(detail, EventRecord) or events.KINDS.get(detail.kind) is not type(detail):
            raise TypeError(f"release {release_id}: {detail!r} is no event record (pipeline/records/events.py)")
        with self._session() as s:
            now = _now()
            if status is not None:
                moved = update(ReleaseRow).where(ReleaseRow.id == release_id)
                if only_from is not None:
                    moved = moved.where(ReleaseRow.status.in_(only_from))
                result = s.execute(
                    moved.values(status=status, updated_at=now), execution_options={"synchronize_session": False}
                )
                if result.rowcount != 1:  # type: ignore[attr-defined]
                    status = None
            # after the UPDATE this transaction holds the row's lock; else take it for the merge
            row = s.get(ReleaseRow, release_id, with_for_update=True, populate_existing=True)
            if row is None:
                raise UnknownRelease(f"release {release_id}: no such release in {self.safe_url}")
            if data is not None:  # the stored facts read typed first: a flat old shape is written back nested
                kept = ReleaseData.model_validate(row.data).model_dump(mode="json", exclude_unset=True)
                row.data = {**kept, **_json_safe(data.model_dump(mode="json", exclude_unset=True))}
            row.updated_at = now
            ev = EventRow(
                release_id=release_id,
                at=now,
                kind=detail.kind,
                actor=actor,
                status_after=status,
                detail=_json_safe(detail.stored()),
            )
            s.add(ev)
            s.flush()
            return Event.of(ev)

    def get(self, release_id: int) -> Release:
        with self._session() as s:
            row = s.get(ReleaseRow, release_id)
            if row is None:
                raise UnknownRelease(f"release {release_id}: no such release in {self.safe_url}")
            return Release.model_validate(row, from_attributes=True)

    def by_run(self, run_key: str) -> Release | None:
        with self._session() as s:
            row = s.scalar(select(ReleaseRow).where(ReleaseRow.run_key == run_key))
            return Release.model_validate(row, from_attributes=True) if row else None

    def releases(self, name: str | None = None, status: str | None = None) -> list[Release]:
        query = select(ReleaseRow).order_by(ReleaseRow.id.desc())
        if name:
            query = query.where(ReleaseRow.name == name)
        if status:
            query = query.where(ReleaseRow.status == status)
        with self._session() as s:
            return [Release.model_validate(r, from_attributes=True) for r in s.scalars(query)]

    def measured_predictions(self) -> Measurements:
        """Every release's benchmarked layouts against the planner, per calibration key, oldest first:
        what the next plan calibrates on and the report's planner table shows."""
        return observations((r.id, r.data.predictions or []) for r in self.releases())

    def keep_profile(self, profile: Profile) -> Profile:
        """Keep a profiling run; the planner uses the newest for its hardware and engine image."""
        with self._session() as s:
            row = ProfileRow(
                hardware=profile.hardware,
                engine_image=profile.engine_image,
                at=profile.measured_at,
                data=profile.model_dump(mode="json", exclude={"id"}),
            )
            s.add(row)
            s.flush()
            return profile.model_copy(update={"id": row.id})

    def profile(self, hardware: str, engine_image: str) -> Profile | None:
        """The newest profiling run on `hardware` with `engine_image`; None: the datasheet's figures stand."""
        query = (
            select(ProfileRow)
            .where(ProfileRow.hardware == hardware, ProfileRow.engine_image == engine_image)
            .order_by(ProfileRow.id.desc())
            .limit(1)
        )
        with self._session() as s:
            row = s.scalar(query)
            return Profile.model_validate({**row.data, "id": row.id}) if row else None

    def events(self, release_id: int) -> list[Event]:
        with self._session() as s:
            rows = s.scalars(select(EventRow).where(EventRow.release_id == release_id).order_by(EventRow.id))
            return [Event.of(r) for r in rows]

    def live(self, name: str, target: str) -> Release | None:
        """The release now serving `name` on `target` (the newest if history ever holds two)."""
        query = (
            select(ReleaseRow)
            .where(ReleaseRow.name == name, ReleaseRow.target == target, ReleaseRow.status.in_(SERVING))
            .order_by(ReleaseRow.id.desc())
        )
        with self._session() as s:
            row = s.scalars(query).first()
            return Release.model_validate(row, from_attributes=True) if row else None

    def previous_live(self, name: str, target: str, before: int) -> Release | None:
        """The newest release before `before` that served: where a rollback goes back to."""
        query = (
            select(ReleaseRow)
            .where(
                ReleaseRow.name == name,
                ReleaseRow.target == target,
                ReleaseRow.id < before,
                ReleaseRow.status.in_((*SERVING, "superseded")),
            )
            .order_by(ReleaseRow.id.desc())
        )
        with self._session() as s:
            row = s.scalars(query).first()
            return Release.model_validate(row, from_attributes=True) if row else None

    @property
    def safe_url(self) -> str:
        """The URL without its password, for messages and logs."""
        return self.engine.url.render_as_string(hide_password=True)


def inputs_of(loaded: LoadedSpec) -> ReleaseInputs:
    """What a release opened from this spec keeps besides the spec's text (read now, once)."""
    path = hardware_path(loaded.spec.hardware, loaded.path)
    return ReleaseInputs(hardware_path=str(path), hardware_yaml=path.read_text(), model_source=resolved_source(loaded))


_REGISTRIES: dict[str, Registry] = {}


def cached(url: str | None = None) -> Registry:
    """One Registry (engine, schema check) per URL per process: tasks and plugin pages call this often."""
    url = url or registry_url()
    if url not in _REGISTRIES:
        _REGISTRIES[url] = Registry(url)
    return _REGISTRIES[url]


def _load_text(chosen: ChosenFigures) -> str:
    """The slowest replica's load time, its phases and source: '29.1 s (to load start 20 s, ...) from local path'."""
    phases = chosen.load_split.phases() if chosen.load_split else ""
    return (
        f"{max(chosen.load_seconds or [0.0]):g} s"
        + (f" ({phases})" if phases else "")
        + (f" from {chosen.weights_source}" if chosen.weights_source else "")
    )


def audit_trail(reg: Registry, release_id: int) -> str:
    """A release and its events as plain text: what `model-release releases show` prints."""
    rel = reg.get(release_id)
    facts, chosen = rel.data, rel.data.chosen
    lines = [
        f"release {rel.id}: {rel.name}  status={rel.status}  target={rel.target}",
        f"  run:       {rel.run_key}",
        f"  spec:      {rel.spec_path}",
        f"  created:   {rel.created_at:%Y-%m-%d %H:%M:%S}  updated: {rel.updated_at:%Y-%m-%d %H:%M:%S}",
    ]
    shown: list[tuple[str, object]] = [
        ("s3_uri", facts.s3_uri),
        ("nfs_path", facts.nfs_path),
        ("manifest_hash", facts.manifest_hash),
        ("layout", chosen.layout if chosen else None),
        ("rate_per_server", chosen.rate_per_server if chosen else None),
        ("endpoint", facts.endpoint),
        ("report", facts.report),
    ]
    for key, value in shown:
        if value not in (None, ""):
            lines.append(f"  {key + ':':<17}{value}")
        if key == "rate_per_server" and chosen and chosen.load_seconds:
            lines.append(f"  {'load time:':<17}{_load_text(chosen)}")
    if facts.capacity:
        lines.append("fleet and cost:")
        table = capacity.table(facts.capacity)
        lines += [f"  {line}" for line in table.splitlines()]
    lines.append("events:")
    for ev in reg.events(release_id):
        status = f" -> {ev.status_after}" if ev.status_after else ""
        detail = ", ".join(f"{k}={_short(v)}" for k, v in ev.detail.stored().items())
        lines.append(
            f"  {ev.at:%Y-%m-%d %H:%M:%S}  {ev.kind:<18} by {ev.actor}{status}" + (f"  ({detail})" if detail else "")
        )
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """Strict JSON (Postgres' json type rejects NaN/Infinity): non-finite numbers become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _short(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
