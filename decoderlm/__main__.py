import sys

from decoderlm.cli import main

sys.exit(main())
