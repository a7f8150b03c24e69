#!/bin/sh
# The production images, each built FROM the base digest recorded in docker/base/ and tagged with
# the package version (pipeline/__init__.py is the one place the tag is named):
#   docker/images.sh freeze                                 record each base's digest and `pip list`
#   docker/images.sh registry.digitalocean.com/<your-registry> [--push]       build (and push)
# from the repository root. `freeze` pulls each Dockerfile's FROM image by its tag and writes
# docker/base/<file>.txt: commit it (the extras were tested against it: tests/test_images.py), and
# mirror the engine image at the same digest. A build refuses a base file without a digest, and the
# Dockerfile refuses a base whose packages moved (docker/check-base.sh).
# The pods' default images are registry.digitalocean.com/model-release/{worker-rocm,quantize}:<version>
# (pipeline/k8s/manifests.py); with another registry, set MODEL_RELEASE_WORKER_IMAGE and
# MODEL_RELEASE_QUANTIZE_IMAGE (docs/helm-values.yaml) to the lines this prints.
set -eu
IMAGES="airflow worker-rocm quantize"
arg() { sed -n "s/^ARG $1=//p" "$2"; }
from_arg() { sed -n 's/^FROM \${\([A-Z_]*\)}$/\1/p' "$1"; }
from_ref() {  # the FROM image's default, with ${ARG}s of the Dockerfile expanded
  ref=$(arg "$(from_arg "$1")" "$1")
  while echo "$ref" | grep -q '\${'; do
    name=$(echo "$ref" | sed -n 's/.*\${\([A-Z_]*\)}.*/\1/p')
    ref=$(echo "$ref" | sed "s|\${$name}|$(arg "$name" "$1")|")
  done
  echo "$ref"
}

if [ "${1:-}" = "freeze" ]; then
  for image in $IMAGES; do
    df="docker/$image.Dockerfile"; base=$(arg BASE_FREEZE "$df"); ref=$(from_ref "$df")
    docker pull "$ref" >&2
    digest=$(docker image inspect --format '{{index .RepoDigests 0}}' "$ref")
    { sed -n '1p' "$base"
      echo "# image: $digest"
      echo "# recorded by docker/images.sh freeze from $ref"
      docker run --rm --entrypoint python3 "$digest" -m pip list --format=freeze
    } > "$base.new"
    mv "$base.new" "$base"
    echo "$base: $digest"
  done
  exit 0
fi

registry=${1:?usage: docker/images.sh REGISTRY [--push] | docker/images.sh freeze}
tag=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' pipeline/__init__.py)
[ -n "$tag" ] || { echo "no __version__ in pipeline/__init__.py" >&2; exit 1; }
for image in $IMAGES; do  # every base checked before anything is built
  base=$(arg BASE_FREEZE "docker/$image.Dockerfile")
  sed -n 's/^# image: //p' "$base" | grep -q '@sha256:' \
    || { echo "$base: no base digest recorded; run docker/images.sh freeze first" >&2; exit 1; }
done
for image in $IMAGES; do
  df="docker/$image.Dockerfile"
  digest=$(sed -n 's/^# image: //p' "$(arg BASE_FREEZE "$df")")
  docker build -f "$df" --build-arg "$(from_arg "$df")=$digest" -t "$registry/$image:$tag" .
  if [ "${2:-}" = "--push" ]; then docker push "$registry/$image:$tag"; fi
  echo "$registry/$image:$tag"
done
