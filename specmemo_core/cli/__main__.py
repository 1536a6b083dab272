"""``python -m specmemo_core.cli``."""

import sys

from specmemo_core.cli.main import main

if __name__ == "__main__":  # importing the module (e.g. walking the package) runs nothing
    sys.exit(main())
