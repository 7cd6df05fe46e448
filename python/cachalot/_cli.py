"""The ``cachalot`` console command: the Rust command line, run inside this process."""

from __future__ import annotations

import signal
import sys
from typing import Optional, Sequence

from . import _native


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs ``cachalot`` with ``argv`` (default: the process's arguments) and exits with its
    code: 0 success, 1 failure while running, 2 bad input, 3 ``fit``'s "does not fit"."""
    args = list(sys.argv[1:] if argv is None else argv)
    # The Rust code does not return to Python until it is done, so Python's handler could
    # never run: Ctrl-C ends the command as it ends the Rust program.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(_native.cli(["cachalot", *args]))
