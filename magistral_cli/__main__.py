"""``python -m magistral_cli`` runs the ``magistral`` command."""

from magistral_cli.cli.main import main

main()
