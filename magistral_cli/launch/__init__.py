"""The torchrun launcher: command, environment, run directory and run identity."""
