"""``python -m genlm_backend``: the ``genlm-backend`` command."""

import sys

from genlm_backend.cli import main

if __name__ == "__main__":
    sys.exit(main())
