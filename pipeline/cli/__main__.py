"""`python -m pipeline.cli`: the same as `model-release` (what tests and the pods' images run)."""

import sys

from pipeline.cli import main

sys.exit(main())
