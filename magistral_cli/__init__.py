"""magistral-cli: the fine-tuning toolchain for Magistral-Small-2509 on PyTorch FSDP2.

Importing this package must stay cheap: no torch, no transformers. The CLI's
``--help`` and ``--version`` rely on it.

Every process that runs our code imports this package first (the CLI, torchrun's ranks, the probes'
workers, spawned rank processes), so the import-time noise of optional packages is quieted here,
once, before anything imports them (``versions.quiet_third_party_logs``).
"""

from magistral_cli.versions import quiet_third_party_logs as _quiet

__version__ = "0.1.0"

_quiet()
