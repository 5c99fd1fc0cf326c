"""`python -m engine_proc.server ...`: the same as `python -m engine_proc serve ...`."""

import sys

from engine_proc.server.cli import main

sys.exit(main())
