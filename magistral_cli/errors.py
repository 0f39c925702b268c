"""Errors that the command line turns into exit codes (see DESIGN.md, "Output for machines").

``UserError`` (exit 2): the input was wrong (bad recipe, missing file, bad flag). The message
names the problem and, where there is one, the fix. No traceback unless ``--debug``.

``CheckFailed`` (exit 1): the input was fine but a check or the work itself failed
(a SHA-256 mismatch, a probe that failed, a training run that exited non-zero).
"""

from __future__ import annotations


class MagistralError(Exception):
    """Base class for errors reported to the user as one clear message."""

    exit_code = 1


class UserError(MagistralError):
    """The input was wrong: exit code 2."""

    exit_code = 2


class CheckFailed(MagistralError):
    """A check or the work failed: exit code 1."""

    exit_code = 1


#: Operating-system errors about the path itself (missing, the wrong kind of file, no permission):
#: the user named a wrong path, exit 2. Every other one (a full or read-only disk, an I/O error) is
#: the machine's, exit 1.
PATH_ERRNOS = frozenset({"ENOENT", "ENOTDIR", "EISDIR", "EEXIST", "EACCES", "EPERM", "ENAMETOOLONG", "ELOOP"})
_OS_FIXES = {
    "ENOSPC": "free space on that disk, or write to another one",
    "EDQUOT": "free space within your disk quota, or write to another disk",
    "EROFS": "that file system is read-only: write to a writable disk",
    "EIO": "the disk reported an I/O error: check the device",
    "ENOENT": "check the path",
    "ENOTDIR": "a file is in the way where a directory is expected: move it or choose another path",
    "EEXIST": "a file is in the way where a directory is expected: move it or choose another path",
    "EISDIR": "a directory is in the way where a file is expected: choose another path",
    "EACCES": "fix its permissions or choose another path",
    "EPERM": "fix its permissions or choose another path",
}


def os_error(exc: OSError) -> MagistralError:
    """An ``OSError`` as one message: the path(s), the error and its errno name, and the fix.

    ``UserError`` when the path itself is wrong (``PATH_ERRNOS``), ``CheckFailed`` otherwise.
    """
    import errno

    name = errno.errorcode.get(exc.errno, "") if isinstance(exc.errno, int) else ""
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    text = exc.strerror or str(exc) or type(exc).__name__
    message = f"{paths}: {text}" if paths else text
    if name:
        message += f" ({name})"
    if name in _OS_FIXES:
        message += f"; {_OS_FIXES[name]}"
    return (UserError if name in PATH_ERRNOS else CheckFailed)(message)
