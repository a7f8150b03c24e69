"""Names env.py and the runner share (env.py runs inside Alembic, not as an import of this package)."""

VERSION_TABLE = "model_release_version"
BASELINE = "0001"
