"""``python -m lightinfer.cli``: the ``lightinfer`` command."""

import sys

from lightinfer.cli import main

sys.exit(main())
