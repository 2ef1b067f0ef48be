"""``python -m normbook.bench``: see :mod:`normbook.bench.cli`."""

import sys

from normbook.bench.cli import main

sys.exit(main())
