"""`python -m sfcore_client`: the `sfcore` command."""

import sys

from .cli import main

sys.exit(main())
