"""``python -m ckptconv.cli``: the same command line as the ``ckptconv`` script."""

from ckptconv.cli.main import console

console()
