"""The library versions the engine supports, and the pre-flight check against the installed ones.

The lower bounds are versions a test actually ran on (``pyproject.toml`` declares the same; a
test keeps the two equal). CI's second leg installs every lower bound that ``pyproject.toml``
declares at once (``.ci/lowest_constraints.py``) and runs the quickstart and the ``compat`` tests:

- transformers 5.17.0: the version current CUDA images ship. Older 5.x releases are refused rather
  than guessed at (see the README's "Supported versions" for what 5.0-5.16 and 4.57 would take).
- torch 2.11 (2.11.0): the oldest torch the project has trained on, a CUDA machine image's (torch
  2.11.0+cu130); the second leg runs PyPI's 2.11.0 on the CPU, the main leg 2.13.

No upper bound: newer releases are what CI's main leg installs.

Optional: torchao >= 0.17 for QLoRA (``model.lora.quantize_base: nf4``; the ``qlora`` extra): the QLoRA
tests pass on 0.17 and 0.18. Its NF4 tensor is ``torchao.dtypes.nf4tensor`` in 0.17 and
``torchao.quantization.quantize_.workflows.nf4.nf4_tensor`` from 0.18 (``engine.qlora`` tries both). Once installed,
torchao is imported by peft as well, on every LoRA run: :func:`quiet_third_party_logs` keeps its
import-time log lines out of the user's output.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import metadata

from magistral_cli.errors import UserError

log = logging.getLogger(__name__)

#: Set to 1 to try an unsupported version anyway: the check then only warns.
SKIP_ENV = "MAGISTRAL_SKIP_VERSION_CHECK"

#: distribution -> the lowest supported version.
MINIMUM_VERSIONS: dict[str, str] = {
    "transformers": "5.17.0",
    "torch": "2.11",
}


#: Optional distribution -> (the lowest supported version, the feature that needs it, the install line).
OPTIONAL_VERSIONS: dict[str, tuple[str, str, str]] = {
    "torchao": ("0.17", "model.lora.quantize_base: nf4", "pip install 'magistral-cli[qlora]'"),
}

#: Loggers whose import-time lines are noise here: torchao's "Failed to load <compiled extension>"
#: for every kernel the machine cannot load (CUDA kernels on a CPU host), and torch's pytree
#: deprecation warning when torchao registers its enums.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party_logs() -> None:
    """Only errors from :data:`QUIET_LOGGERS` (imports nothing; call before torchao or peft is imported)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def optional_problem(distribution: str, installed: dict[str, str | None] | None = None) -> str | None:
    """Why ``distribution`` (a key of :data:`OPTIONAL_VERSIONS`) cannot serve its feature, or None.

    ``installed`` maps distribution -> version (default: what this environment has).
    """
    minimum, feature, install = OPTIONAL_VERSIONS[distribution]
    version = installed_version(distribution) if installed is None else installed.get(distribution)
    if version is None:
        return f"{feature} needs {distribution}, which is not installed; run {install}"
    if is_older(version, minimum):
        return f"{feature} needs {distribution}>={minimum} and {version} is installed; run {install}"
    return None


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '2.11.0+cu130' -> (2, 11, 0), '5.0.0rc1' -> (5, 0, 0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)


def is_older(installed: str, minimum: str) -> bool:
    """Whether ``installed`` is a release below ``minimum`` (pre-releases of ``minimum`` count as it)."""
    a, b = _release(installed), _release(minimum)
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) < b + (0,) * (width - len(b))


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_supported_versions(installed: dict[str, str | None] | None = None) -> None:
    """Raise UserError naming the installed and the lowest supported version of each library that is too old.

    ``installed`` maps distribution -> version (default: what this environment has).
    """
    problems = []
    for name, minimum in MINIMUM_VERSIONS.items():
        version = installed_version(name) if installed is None else installed.get(name)
        if version is None:
            problems.append(f"{name} is not installed (magistral needs {name}>={minimum})")
        elif is_older(version, minimum):
            problems.append(f"{name} {version} is installed; magistral needs {name}>={minimum}")
    if not problems:
        return
    if os.environ.get(SKIP_ENV) == "1":
        log.warning("%s; continuing because %s=1 (untested)", "; ".join(problems), SKIP_ENV)
        return
    raise UserError(
        "; ".join(problems)
        + ". Upgrade it in this environment (for example pip install 'transformers>="
        + MINIMUM_VERSIONS["transformers"]
        + "'); on a CUDA or Ascend machine keep your torch build and upgrade transformers only "
        f"({SKIP_ENV}=1 tries the installed versions anyway, untested)"
    )
