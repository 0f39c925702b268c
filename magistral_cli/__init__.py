"""magistral-cli: the fine-tuning toolchain for Magistral-Small-2509 on PyTorch FSDP2.

Importing this package must stay cheap: no torch, no transformers. The CLI's
``--help`` and ``--version`` rely on it.
"""

__version__ = "0.1.0"
