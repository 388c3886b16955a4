"""``python -m flexattn_zoo.bench CONFIG.yaml ...``: the benchmark harness."""

import sys

from flexattn_zoo.bench.runner import main

sys.exit(main())
