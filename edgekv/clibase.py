"""The click group every edgekv command line uses: an EdgekvError becomes one line on stderr and exit code 2."""
from __future__ import annotations

import sys

import click

from .errors import EdgekvError


class Group(click.Group):
    """Every EdgekvError becomes one line on stderr and exit code 2, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EdgekvError as e:
            click.echo(f"edgekv: error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("edgekv: interrupted", err=True)
            sys.exit(130)
