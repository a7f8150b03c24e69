"""What a test checks is gone after an engine stops: the processes an engine start leaves behind.

Only this test session's: a process group counts when one of its processes names this checkout or
this session's temporary directory in its command line (the engine's script, its model or home,
the front's config), so engines of another checkout or suite on the same machine are not taken
for ours (the e2e test failed on one while a second suite ran beside it)."""

from __future__ import annotations

import re
import subprocess

from pipeline.core.paths import PROJECT_ROOT

ENGINE = re.compile(r"vllm_cli\.py serve|VLLM::|nginx: (master|worker)")
# what names a process as this session's; conftest adds the session's pytest temporary root
ROOTS: list[str] = [f"{PROJECT_ROOT}/"]


def engine_processes(groups: set[int] | None = None) -> list[tuple[int, str]]:
    """(process group, command) of this session's live (not zombie) engine API servers, vLLM
    EngineCore/worker processes and nginx masters and workers; of the process `groups` only, when
    given."""
    out = subprocess.run(["ps", "-ww", "-eo", "pgid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [(int(f[0]), f[1], f[2]) for f in (line.split(None, 2) for line in out.splitlines()) if len(f) == 3]
    ours = {pgid for pgid, _, args in rows if any(root in args for root in ROOTS)}
    return [
        (pgid, args)
        for pgid, stat, args in rows
        if not stat.startswith("Z") and ENGINE.search(args) and pgid in ours and (groups is None or pgid in groups)
    ]
