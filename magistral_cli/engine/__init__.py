"""What torchrun runs: the FSDP2 training engine. Imports nothing from ``magistral_cli.cli``."""
