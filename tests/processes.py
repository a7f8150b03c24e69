"""What a test checks is gone after an engine stops: the processes an engine start leaves behind."""

from __future__ import annotations

import re
import subprocess

ENGINE = re.compile(r"vllm_cli\.py serve|VLLM::|nginx: (master|worker)")


def engine_processes(groups: set[int] | None = None) -> list[tuple[int, str]]:
    """(process group, command) of live (not zombie) engine API servers, vLLM EngineCore/worker
    processes and nginx masters and workers; of the process `groups` only, when given."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    return [
        (int(pgid), args)
        for pgid, stat, args in rows
        if not stat.startswith("Z") and ENGINE.search(args) and (groups is None or int(pgid) in groups)
    ]
