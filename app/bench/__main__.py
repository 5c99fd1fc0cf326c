"""`python -m app.bench ...`: the benchmark suite (app/bench/suite.py)."""

import sys

from app.bench.suite import main

sys.exit(main())
