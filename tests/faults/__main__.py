"""``python -m tests.faults``: the fault matrix (see tests/faults/matrix.py)."""

import sys
from pathlib import Path

# The package is found as ``faults`` from the tests directory, as pytest finds it, so that one
# copy of its modules is loaded whichever way it was started; tests/servers.py lives there too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faults.matrix import main  # noqa: E402

sys.exit(main())
