"""A real PostgreSQL server for the suite: Debian's binaries in a temporary data directory,
listening on a unix socket only (no port to collide with another run), as an unprivileged user
(initdb and postgres refuse root). Roles as production has them (docker/postgres-init.sh): the
owner runs the migrations; the pipeline logs in as `model_release_app`, a member of the group role
`model_release_runtime` that the migrations grant reading, appending and status changes to."""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

OWNER = "model_release_owner"
APP = "model_release_app"
RUNTIME = "model_release_runtime"
OS_USER = "model-release-pg"  # the unprivileged user the server runs as, when the suite runs as root
SUPERUSER = "postgres"


def binaries() -> Path | None:
    """The newest installed server's bin directory (/usr/lib/postgresql/<major>/bin), if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


def _os_user() -> pwd.struct_passwd | None:
    """Who runs the server: a dedicated system user when we are root (created if missing), else us."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(OS_USER)
    except KeyError:
        # another run may create it at the same moment: its "already exists" is fine
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OS_USER], check=False
        )
        return pwd.getpwnam(OS_USER)


class Server:
    """One running server; `url(role, database)` for SQLAlchemy, `database()` a fresh one owned by OWNER."""

    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.user = _os_user()
        self.root = Path(tempfile.mkdtemp(prefix="model-release-pg-"))
        self.data = self.root / "data"
        self._names = itertools.count(1)
        if self.user:
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "--no-sync", "-E", "UTF8")
        options = f"-k {self.root} -c listen_addresses='' -c fsync=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-o", options, "start")
        self.sql(
            "postgres",
            f"CREATE ROLE {OWNER} LOGIN",
            f"CREATE ROLE {RUNTIME} NOLOGIN",
            f"CREATE ROLE {APP} LOGIN IN ROLE {RUNTIME}",
        )

    def _run(self, tool: str, *args: str) -> None:
        kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid} if self.user else {}
        done = subprocess.run(
            [str(self.bin / tool), *args], cwd=self.root, capture_output=True, text=True, check=False, **kwargs
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")

    def url(self, role: str, database: str) -> str:
        return f"postgresql+psycopg://{role}@/{database}?host={self.root}"

    def sql(self, database: str, *statements: str) -> None:
        """Run statements as the superuser (autocommit: CREATE DATABASE refuses a transaction)."""
        import psycopg

        with psycopg.connect(host=str(self.root), user=SUPERUSER, dbname=database, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)  # type: ignore[arg-type]

    def database(self) -> str:
        """A new empty database owned by the owner role (its public schema with it, as in production)."""
        name = f"registry_{next(self._names)}"
        self.sql("postgres", f"CREATE DATABASE {name} OWNER {OWNER}")
        return name

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
