"""`python -m tqattn`: the same command line as the `tqattn` script."""

import sys

from .cli import main

sys.exit(main())
