"""``python -m guardtrain.bench``."""

import sys

from guardtrain.bench.command import main

sys.exit(main())
