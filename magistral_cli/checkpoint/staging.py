"""Write a new output directory all at once: into a hidden sibling, renamed at the end.

A conversion never touches an existing directory (existing checkpoints are preserved), and a
failure (an error, a check that fails, Ctrl-C) removes what it had written: the target either
appears complete or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from magistral_cli.errors import UserError


def refuse_existing(target: Path, what: str) -> None:
    if target.exists() or target.is_symlink():
        raise UserError(
            f"{what} {target} already exists; existing checkpoints are preserved: pass a new directory"
        )


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextmanager
def staged_directory(target: str | Path, what: str = "output directory") -> Iterator[Path]:
    """Yield a fresh temporary directory next to ``target``; rename it to ``target`` on success."""
    target = Path(target)
    refuse_existing(target, what)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield tmp
        refuse_existing(target, what)  # created by someone else meanwhile
        umask = _umask()
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private
        for path in tmp.rglob("*"):
            if path.is_file() and not path.is_symlink() and not path.stat().st_mode & 0o044:
                # a writer that made its file private (safetensors' save_file writes 0600): the
                # files of an export get the mode any file created here would have
                os.chmod(path, 0o666 & ~umask)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
