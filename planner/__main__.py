"""``python -m planner`` runs the ``tessera`` command line."""

import sys

from planner.cli import main

sys.exit(main())
