# The quantize pod: FP8 conversion with llmcompressor as the project tests it (0.14.0.1, transformers 5,
# compressed-tensors 0.19, CPU torch 2.13.0), which cannot sit beside the worker image's vLLM 0.11.2
# (transformers < 5, compressed-tensors 0.12.2). The production spec quantizes `model_free` on CPUs
# (pods.resources gives it no GPU), so no ROCm stack: a plain Python base. A spec that quantizes
# `oneshot` on a GPU would need a ROCm torch >= 2.10 here instead. docker/images.sh builds it FROM the
# digest recorded in docker/base/python-slim.txt; pods take it from MODEL_RELEASE_QUANTIZE_IMAGE.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG EXTRA=quantize
ARG BASE_FREEZE=docker/base/python-slim.txt
ENV MODEL_RELEASE_HOME=/var/lib/model-release \
    HF_HUB_OFFLINE=1

WORKDIR /opt/model-release
COPY docker/check-base.sh ./docker/
COPY docker/base/python-slim.txt ./docker/base/
RUN sh docker/check-base.sh "${BASE_FREEZE}"
COPY pyproject.toml ./
COPY pipeline ./pipeline
COPY configs ./configs
# The one list: the extra. torch's CPU build from PyTorch's index (PyPI's is the CUDA one, GBs larger).
RUN pip install --no-cache-dir --constraint "${BASE_FREEZE}" \
      --extra-index-url https://download.pytorch.org/whl/cpu --editable ".[${EXTRA}]"
ENTRYPOINT ["model-release"]
CMD ["--help"]
