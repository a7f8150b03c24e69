#!/usr/bin/env bash
# Create or update the project's two virtualenvs. Idempotent: a venv is touched only when
# its requirement or lock files changed since it was last installed (a stamp records their hash).
#   scripts/setup.sh [main|docs|serve|images|system|demo|all]      (default: all; docs includes main)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP_FLAGS=(--quiet --disable-pip-version-check --no-input)

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

ensure_venv() {
  local venv=$1 want=$2; shift 2
  if [[ -f $venv/.setup-stamp && $(cat "$venv/.setup-stamp") == "$want" ]]; then
    echo "setup: $venv up to date"; return 1
  fi
  echo "setup: installing $venv (first time takes a few minutes)"
  [[ -x $venv/bin/python ]] || "$PY" -m venv "$venv"
  return 0
}

setup_main() {
  local want; want=$(stamp_of requirements/main.in requirements/main.lock pyproject.toml)
  ensure_venv .venv "$want" || return 0
  .venv/bin/pip install "${PIP_FLAGS[@]}" -c requirements/main.lock -r requirements/main.in
  .venv/bin/pip install "${PIP_FLAGS[@]}" --no-deps -e .
  echo "$want" > .venv/.setup-stamp
}

setup_docs() {
  # the docs site's builder (mkdocs + mkdocs-material, a dozen small wheels) in the main venv: the suite
  # builds the site (tests/test_docs.py); main.lock pins what the two share
  local want; want=$(stamp_of requirements/docs.in requirements/docs.lock requirements/main.lock)
  if [[ -f .venv/.docs-stamp && $(cat .venv/.docs-stamp) == "$want" ]]; then
    echo "setup: docs tools up to date"; return 0
  fi
  echo "setup: installing the docs tools into .venv"
  .venv/bin/pip install "${PIP_FLAGS[@]}" -c requirements/main.lock -c requirements/docs.lock -r requirements/docs.in
  echo "$want" > .venv/.docs-stamp
}

setup_serve() {
  local want; want=$(stamp_of requirements/serve.in requirements/serve.lock)
  ensure_venv .venv-serve "$want" || return 0
  .venv-serve/bin/pip install "${PIP_FLAGS[@]}" -c requirements/serve.lock -r requirements/serve.in
  # pip brings CUDA builds of these; they cannot load beside CPU torch and break transformers
  # ("operator torchvision::nms does not exist"). vLLM serves text models without them.
  .venv-serve/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > .venv-serve/.setup-stamp
}

setup_images() {
  # one clean venv per production image (tests/test_images.py): the extra its Dockerfile installs
  # (ARG EXTRA), constrained by its base's committed freeze (ARG BASE_FREEZE), rebuilt from scratch
  # when either changes. GPU builds cannot install here, so two stand-ins, named in the test too:
  # a ROCm torch pin becomes the CPU torch 2.13.0 on local disk, and vLLM (ROCm) is left out.
  local df name extra base venv want
  for df in docker/*.Dockerfile; do
    name=$(basename "$df" .Dockerfile)
    extra=$(sed -n 's/^ARG EXTRA=//p' "$df")
    base=$(sed -n 's/^ARG BASE_FREEZE=//p' "$df")
    if [[ -z $extra || ! -f $base ]]; then echo "setup: $df: no ARG EXTRA or no ARG BASE_FREEZE file" >&2; return 1; fi
    venv=.venv-images/$name
    want=$(printf '%s\n' "$extra" | cat pyproject.toml "$base" - | sha256sum | cut -c1-16)
    if [[ -f $venv/.setup-stamp && $(cat "$venv/.setup-stamp") == "$want" ]]; then
      echo "setup: $venv up to date"; continue
    fi
    echo "setup: building $venv (clean, from pip's cache)"
    rm -rf "$venv" && "$PY" -m venv "$venv"
    sed -E -e 's/^torch==.*/torch==2.13.0/' -e '/^vllm==/d' "$base" > "$venv/base-constraints.txt"
    "$venv/bin/pip" install "${PIP_FLAGS[@]}" --constraint "$venv/base-constraints.txt" ".[$extra]"
    "$venv/bin/pip" uninstall --quiet --yes model-release  # the probe runs the checkout's own code
    echo "$want" > "$venv/.setup-stamp"
  done
}

setup_system() {
  # nginx balances a layout's replicas behind one endpoint, as a Service does in production; the
  # local target's rollouts read the engines' live p90s through a real Prometheus server; the
  # end-to-end test opens the plugin page in Debian's headless Chromium (Playwright drives it).
  # The registry's tests run on a real PostgreSQL started from Debian's server binaries.
  # One apt-get update for whatever is missing.
  local want=() tests=${1:-yes}  # no: make demo's needs only (no browser, no database server)
  command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || want+=(nginx-light)
  command -v prometheus >/dev/null || [[ -x /usr/bin/prometheus ]] || want+=(prometheus)
  [[ $tests == no || -x /usr/bin/chromium ]] || want+=(chromium)
  [[ $tests == no ]] || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || want+=(postgresql)
  [[ ${#want[@]} -eq 0 ]] && return 0
  echo "setup: installing ${want[*]} (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
}

timed() {
  local started=$SECONDS
  "$@"
  (( SECONDS - started < 2 )) || echo "setup: $1 took $(( SECONDS - started )) s"
}

case ${1:-all} in
  main) timed setup_main ;;
  docs) timed setup_main; timed setup_docs ;;
  serve) timed setup_serve ;;
  images) timed setup_images ;;
  system) timed setup_system ;;
  # what make demo needs: no browser, no docs tools, no image venvs; the two venvs install side by side
  demo)
    timed setup_system no
    timed setup_serve & serve=$!
    timed setup_main
    wait "$serve"
    ;;
  # the venvs are mostly downloads and unpacking: the engine's and the images' beside the main one
  all)
    timed setup_system
    timed setup_serve & serve=$!
    timed setup_images & images=$!
    timed setup_main
    timed setup_docs
    wait "$serve"
    wait "$images"
    ;;
  *) echo "usage: $0 [main|docs|serve|images|system|demo|all]" >&2; exit 2 ;;
esac
