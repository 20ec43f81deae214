import sys

from sfcore_daemon.cli import main

sys.exit(main())
