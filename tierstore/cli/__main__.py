"""``python -m tierstore.cli``: the ``tierstore`` command."""

import sys

from tierstore.cli import main

sys.exit(main())
