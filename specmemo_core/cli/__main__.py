import sys

from specmemo_core.cli import main

sys.exit(main())
