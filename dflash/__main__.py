"""``python -m dflash`` runs the same CLI as the ``dflash`` command."""

from dflash.cli import main

if __name__ == "__main__":
    main()
