"""The ``flexattn-zoo`` command line (also ``python -m flexattn_zoo``)."""

from flexattn_zoo.cli.app import main

__all__ = ["main"]
