"""``python -m app`` starts SpecMemo Chat."""

import sys

from .cli import main

sys.exit(main())
