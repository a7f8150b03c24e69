"""Stand-ins the tests and `benchmarks/` share: a local S3 server and fault proxy, an M/M/1
OpenAI-compatible stub, a real HTTP endpoint, judged stand-in probes.

Top level beside `tests/`, so `benchmarks/` never imports a test module; not packaged (pyproject
ships only `pipeline*`), and `pipeline/` never imports it (tests/test_structure.py)."""
