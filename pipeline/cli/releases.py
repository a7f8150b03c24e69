"""The registry's releases (list, show, roll back) and a reviewer's approve / reject over Airflow's REST API."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pipeline.cli.common import emit
from pipeline.core.errors import ReleaseError


def _releases(args: argparse.Namespace) -> int:
    from pipeline.release import migrations, registry

    if args.action == "migrate":  # opening upgrades; with the owner's URL where the runtime role may not
        reg = registry.Registry(registry.with_driver(args.url) if args.url else None)
        emit(f"registry {reg.safe_url}: at revision {migrations.head()} (was {reg.migrated_from})")
        return 0
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
        emit(f"release {rel.id} is {rel.status} again ({rel.data.endpoint})")
        return 0
    rows = reg.releases(name=args.name, status=args.status)
    emit(f"{'id':>4}  {'release':28} {'status':12} {'target':10} {'layout':14} {'req/s/server':>12}  created (UTC)")
    for rel in rows:
        rate = rel.data.chosen.rate_per_server if rel.data.chosen else None
        emit(
            f"{rel.id:>4}  {rel.name:28} {rel.status:12} {rel.target:10} {rel.data.layout or '-':14} "
            f"{(f'{rate:.3g}' if rate is not None else '-'):>12}  {rel.created_at:%Y-%m-%d %H:%M}"
        )
    return 0


def _recover(args: argparse.Namespace) -> int:
    from pipeline.release import promote, registry

    for line in promote.recover_model(registry.Registry(), args.name, getattr(args, "as"), wait_s=args.wait):
        emit(line)
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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
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
    q = rs.add_parser(
        "migrate", help="bring the registry's schema to this version's head (as the owner role, on Postgres)"
    )
    q.add_argument("--url", help="the registry's URL as its owner (default: the registry's own URL)")
    p.set_defaults(func=_releases)

    p = sub.add_parser(
        "recover",
        help="on-call: take the model's controller lock, bring a rollout or rollback whose controller died to a "
        "safe end (and a keep window nobody finished), print what was found and done",
    )
    p.add_argument("name", help="the model (the spec's name)")
    p.add_argument("--as", default="sre-oncall", metavar="USER", help="who recovers (recorded)")
    p.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS", help="wait this long for another controller's lock"
    )
    p.set_defaults(func=_recover)

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
