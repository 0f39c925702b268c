"""Ending a rank process.

After a gloo process group is destroyed, the interpreter's normal teardown can still abort the
process ("terminate called without an active exception", SIGABRT) while C++ static objects are
destroyed under a background communication thread. It happened in about 1 of 15 otherwise
successful CPU runs here, after all the work was done, and torchrun or ``mp.spawn`` then report the
rank as failed. A rank whose work is finished therefore flushes its output and leaves with
``os._exit``, skipping that teardown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def finish_rank_process(code: int = 0) -> NoReturn:
    """Flush logs and standard streams, then end this process with ``code`` at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream must not change the exit code.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
