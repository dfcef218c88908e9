"""The ``liger-lab`` command line."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="liger-lab")
def main() -> None:
    """Fused Triton kernels for LLM training: check them, benchmark them, regenerate the exercises."""


@main.command()
def exercises() -> None:
    """Regenerate chapters/ (exercise notebooks) from solutions/."""
    from liger_lab.chapters import generate

    for path in generate():
        click.echo(f"wrote {path}")
