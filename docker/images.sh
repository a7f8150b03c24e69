#!/bin/sh
# Build the two production images, tagged with the package version (pipeline/__init__.py is the
# one place the tag is named), and push them with --push:
#   docker/images.sh registry.digitalocean.com/<your-registry> [--push]     (from the repository root)
# The pods' default image is registry.digitalocean.com/model-release/worker-rocm:<version>
# (pipeline/k8s/pods.py); with another registry, set MODEL_RELEASE_WORKER_IMAGE
# (docs/helm-values.yaml) to the worker-rocm line this prints.
set -eu
registry=${1:?usage: docker/images.sh REGISTRY [--push]}
tag=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' pipeline/__init__.py)
[ -n "$tag" ] || { echo "no __version__ in pipeline/__init__.py" >&2; exit 1; }
for image in airflow worker-rocm; do
  docker build -f "docker/$image.Dockerfile" -t "$registry/$image:$tag" .
  if [ "${2:-}" = "--push" ]; then docker push "$registry/$image:$tag"; fi
  echo "$registry/$image:$tag"
done
