"""model-release: take a MoE LLM from a BF16 checkpoint to SLO-verified vLLM serving.

Every stage is a plain function `stage(spec, inputs) -> pydantic result`, callable from the
CLI, an Airflow task, a pod or a test alike. Nothing here imports Airflow.
"""

__version__ = "0.1.0"
