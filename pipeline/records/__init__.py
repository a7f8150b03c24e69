"""Records that cross an edge: a task's XCom, a pod's result file, the registry.

Each module holds one stage's records and imports nothing from the project but `pipeline.core`
(an import-linter contract), so a DAG file, a pod or a test can read them without the stage's
machinery. `edge` is the one place a record becomes JSON and back.
"""
