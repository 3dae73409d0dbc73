"""`python -m dsv4 ...` is the `dsv4` command."""

import sys

from .cli import main

sys.exit(main())
