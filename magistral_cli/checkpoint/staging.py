"""Write a new output directory all at once: into a hidden sibling, renamed at the end.

A conversion never touches an existing directory (existing checkpoints are preserved), and a
failure (an error, a check that fails, Ctrl-C) removes what it had written: the target either
appears complete or not at all.

Modes: what appears has the modes the user's umask gives a new file or directory, whatever made
them (``mkdtemp`` makes its directory private, safetensors' ``save_file`` writes 0600, a copy
that kept its source's mode would carry that over): files copied in are copied by contents
(``shutil.copyfile``), and every entry is set to ``0o666`` / ``0o777`` less the umask before the
rename.
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


def current_umask() -> int:
    """The process's umask (read by setting it and back: there is no other way to read it)."""
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
        umask = current_umask()
        os.chmod(tmp, 0o777 & ~umask)
        for path in tmp.rglob("*"):
            if path.is_symlink():
                continue
            if path.is_dir():
                os.chmod(path, 0o777 & ~umask)
            elif path.is_file():
                os.chmod(path, 0o666 & ~umask)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
