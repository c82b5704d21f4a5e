"""``python -m ckptconv.cli``: the same command line as the ``ckptconv`` script."""

import sys

from ckptconv.cli.main import main

sys.exit(main())
