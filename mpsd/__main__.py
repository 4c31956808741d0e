import sys

from mpsd.cli import main

sys.exit(main())
