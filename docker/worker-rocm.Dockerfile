# GPU worker for the engine-side steps on MI325X nodes: the evaluate, stage, benchmark and remeasure
# pods, and the serving pods' fetch / verify-staged init containers (manifests' fetch_image): the
# ROCm vLLM image plus this project's CLI with its `worker` extra (pyproject.toml), nothing else.
# The quantize pod runs docker/quantize.Dockerfile instead: llmcompressor as tested (0.14.0.1) needs
# transformers 5 and compressed-tensors 0.19, and this base's vLLM 0.11.2 needs transformers < 5 and
# compressed-tensors 0.12.2; an older llmcompressor here would be one the project never ran, so the
# two live in two images (docs/production.md). The engine tag is pinned here, in one place; release
# specs name the same engine (serving.engine_image, checked by tests). docker/images.sh builds it
# FROM the digest recorded in docker/base/rocm-vllm.txt; pods take it from MODEL_RELEASE_WORKER_IMAGE.
ARG ROCM_VLLM_IMAGE=rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210
FROM ${ROCM_VLLM_IMAGE}
ARG EXTRA=worker
ARG BASE_FREEZE=docker/base/rocm-vllm.txt

# AITER kernels and the loader settings of the reference deployment; specs may override.
ENV VLLM_USE_V1=1 \
    VLLM_ROCM_USE_AITER=1 \
    VLLM_ROCM_USE_AITER_MOE=1 \
    VLLM_USE_TRITON_FLASH_ATTN=0 \
    SAFETENSORS_FAST_GPU=1 \
    HIP_FORCE_DEV_KERNARG=1 \
    TORCH_BLAS_PREFER_HIPBLASLT=1 \
    MODEL_RELEASE_HOME=/var/lib/model-release \
    HF_HUB_OFFLINE=1

WORKDIR /opt/model-release
COPY docker/check-base.sh ./docker/
COPY docker/base/rocm-vllm.txt ./docker/base/
RUN sh docker/check-base.sh "${BASE_FREEZE}"
COPY pyproject.toml ./
COPY pipeline ./pipeline
COPY configs ./configs
# The one list: the extra, with the base's own packages (torch, vLLM, transformers) held as they are.
# Editable install: `pipeline` finds configs/ (eval tasks, hardware profiles) next to itself.
RUN pip install --no-cache-dir --constraint "${BASE_FREEZE}" --editable ".[${EXTRA}]"
ENTRYPOINT ["model-release"]
CMD ["--help"]
