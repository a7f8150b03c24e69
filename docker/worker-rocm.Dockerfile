# GPU worker for the heavy stages (quantize, evaluate, benchmark, fetch) on MI325X nodes:
# the ROCm vLLM image plus this project's CLI, llmcompressor and lm-eval.
# The engine image tag is pinned here, in one place; release specs name the same engine
# (serving.engine_image, checked by tests). Build and push with docker/images.sh, which tags
# this image with the package version; pods take it from MODEL_RELEASE_WORKER_IMAGE.
ARG ROCM_VLLM_IMAGE=rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210
FROM ${ROCM_VLLM_IMAGE}

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
COPY pyproject.toml ./
COPY pipeline ./pipeline
COPY configs ./configs
# torch, vllm and transformers come with the base image: install ours without touching them.
# Editable install: `pipeline` finds configs/ (eval tasks, hardware profiles) next to itself.
RUN pip freeze | grep -Ei '^(torch|vllm|transformers|triton)==' > /tmp/base-pins.txt \
 && pip install --no-cache-dir --constraint /tmp/base-pins.txt \
      llmcompressor lm-eval great-expectations boto3 pydantic pyyaml matplotlib \
 && pip install --no-cache-dir --no-deps --editable .
ENTRYPOINT ["model-release"]
CMD ["--help"]
