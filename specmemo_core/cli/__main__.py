"""``python -m specmemo_core.cli``."""

import sys

from specmemo_core.cli.main import main

sys.exit(main())
