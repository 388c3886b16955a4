"""``python -m flexattn_zoo`` runs the ``flexattn-zoo`` CLI."""

import sys

from flexattn_zoo.cli import main

if __name__ == "__main__":
    sys.exit(main())
