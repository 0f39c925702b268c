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
