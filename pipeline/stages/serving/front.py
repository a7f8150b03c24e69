"""The local front: nginx in front of a layout's replicas (least-connections, or weighted for a
rollout step), its config written atomically so a reload never reads half of one, and the access
log line (`FRONT_LOG`) a rollout step reads."""

from __future__ import annotations

import os
import re
import resource
import shutil
from pathlib import Path

from pipeline.core.errors import ReleaseError
from pipeline.core.files import atomic_write
from pipeline.stages import drain

# vLLM's API server (uvicorn) closes a connection idle this long: VLLM_HTTP_TIMEOUT_KEEP_ALIVE's default
ENGINE_KEEP_ALIVE_S = 5.0


def engine_keep_alive_s(env: dict[str, str]) -> float:
    """The idle seconds after which an engine started with `env` over ours closes a connection
    (vLLM's variable where set, else its default): what the front must stay under."""
    value = {**os.environ, **env}.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    if value is None:
        return ENGINE_KEEP_ALIVE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ReleaseError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE={value!r}: not a positive number of seconds")
    return seconds


def nginx_binary() -> str:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise ReleaseError("nginx is not installed (scripts/setup.sh installs it with apt-get)")
    return nginx


# a line of the front's access log: time (s), status, then the engines tried ("127.0.0.1:8001,
# 127.0.0.1:8002") and what each answered ("502, 200"; "-": no answer)
FRONT_LOG = re.compile(r'^(?P<time>[\d.]+) (?P<status>\d+) "(?P<addrs>[^"]*)" "(?P<statuses>[^"]*)"')


def write_nginx_conf(
    root: Path,
    port: int,
    backends: list[int],
    locations: str = "",
    access_log: bool = False,
    weights: dict[int, int] | None = None,
    engine_keep_alive_s: float = ENGINE_KEEP_ALIVE_S,
) -> Path:
    """nginx on 127.0.0.1:`port`, least-connections over `backends`, its state under `root`;
    `locations`: extra location blocks. `access_log`: one line per request in `FRONT_LOG`'s form
    (the time, the status, every engine tried and what each answered), which a rollout step reads.
    With `weights` (port -> weight) the split is weighted round robin instead: a share of requests,
    which least-connections would bend away from a slow backend. Written to a temporary file and
    renamed: a reload must never read half a config."""
    conf = root / "nginx.conf"
    # every request in flight holds two connections (client and engine side): at 1024, nginx reset
    # 37% of the requests of a probe at twice the two-replicas layout's capacity (and a slower
    # machine's whole probe), which the engine alone queues without a failure. A Service does not
    # drop connections; the front must not either, within what the process may open.
    files = min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    # an idle kept-alive engine connection is closed by nginx (at 80% of the engine's keep-alive) before
    # the engine's server closes it: reused as uvicorn closes it, a request is reset and answered 502
    # (2 requests of the e2e's two-replicas probes, one a 2.5% failure that moved its answer down)
    idle_ms = int(engine_keep_alive_s * 800)
    balance = "" if weights else "least_conn;"
    upstreams = "".join(f"server 127.0.0.1:{p}{f' weight={weights[p]}' if weights else ''};" for p in backends)
    atomic_write(
        conf,
        f"daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/nginx-error.log;\n"
        f"worker_rlimit_nofile {files}; events {{ worker_connections {max(1024, files // 2)}; }}\n"
        f'http {{ log_format front \'$msec $status "$upstream_addr" "$upstream_status" "$request"\';'
        f" access_log {f'{root}/access.log front' if access_log else 'off'};"
        f" upstream engines {{ {balance} {upstreams} keepalive 64; keepalive_timeout {idle_ms}ms; }}\n"
        f"  client_body_temp_path {root}/nginx-body; proxy_temp_path {root}/nginx-proxy;\n"
        f"  server {{ listen 127.0.0.1:{port} backlog=4096; {locations}\n"
        f"    location / {{ proxy_pass http://engines; proxy_http_version 1.1;\n"
        f'    proxy_set_header Connection ""; proxy_buffering off;'
        f" proxy_read_timeout {drain.REQUEST_TIMEOUT_S}s; }} }} }}\n",
    )
    return conf
