"""``python -m benchmarks``, from a checkout of the repository."""

import sys

from benchmarks.command import main

sys.exit(main())
