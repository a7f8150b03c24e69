#!/bin/sh
# Refuse to build on a base image whose packages are not the ones committed in docker/base/:
#   docker/check-base.sh docker/base/NAME.txt        (inside the base image, before anything is installed)
# The extras were resolved against that file; a base that moved under its tag, or a stand-in that was
# never replaced by the real freeze (docker/images.sh freeze), would install something untested.
set -eu
committed=$1
if grep -q '^# stand-in:' "$committed"; then
  echo "$committed: a stand-in, not this base's freeze; record it with: docker/images.sh freeze" >&2
  exit 1
fi
norm() { grep -v '^#' | grep -v '^$' | tr 'A-Z_.' 'a-z--' | sed 's/-=-=/==/' | sort; }
python3 -m pip list --format=freeze 2>/dev/null | norm > /tmp/base-now.txt
norm < "$committed" > /tmp/base-committed.txt
if ! cmp -s /tmp/base-now.txt /tmp/base-committed.txt; then
  echo "$committed: this base's packages differ (< committed, > base); record them with: docker/images.sh freeze" >&2
  diff /tmp/base-committed.txt /tmp/base-now.txt >&2 || true
  exit 1
fi
