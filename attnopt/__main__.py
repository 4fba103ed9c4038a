"""`python -m attnopt ...` runs the command line."""

import sys

from attnopt.cli import main

sys.exit(main())
