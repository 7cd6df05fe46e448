"""``python -m cachalot ...``: the ``cachalot`` command."""

from ._cli import main

main()
