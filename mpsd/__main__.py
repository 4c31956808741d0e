import sys

from mpsd.daemon.cli import main

sys.exit(main())
