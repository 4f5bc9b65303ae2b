"""The ``megamoe`` app: every command of :data:`COMMANDS` in display order, built once per process.
``megamoe_convert.cli`` hands it out (``from megamoe_convert.cli import app``) and runs it (``main``)."""

from __future__ import annotations

from typing import Annotated, Any, Callable

import typer

from megamoe_convert import __version__
from megamoe_convert.cli import _run, conventions, convert, inspect, merge, plan, preload, pull, push, synth, verify
from megamoe_convert.source import engines_table

#: Every command in display order: its name, its function (the namesake of its module), the line the
#: command list shows (click would cut the docstring at 45 characters), and further ``app.command`` settings.
COMMANDS: list[tuple[str, Callable[..., Any], str, dict[str, Any]]] = [
    ("synth", synth.synth, "Write a random test checkpoint of a supported model family.", {}),
    ("inspect", inspect.inspect, "Show what a checkpoint or a conversion holds, and how to serve it.", {}),
    ("plan", plan.plan, "Show which logical experts every rank holds.", {}),
    ("convert", convert.convert, "Convert a checkpoint into per-rank MegaMoE files and a manifest.", {}),
    ("verify", verify.verify, "Check a conversion (checksums; bytes, numerics vs the source).", {}),
    ("push", push.push, "Upload a conversion to the Hugging Face hub.", {}),
    ("pull", pull.pull, "Download a pushed conversion, only the ranks you name.", {}),
    ("merge", merge.merge, "Assemble the parts of a split conversion (convert --shard).", {}),
    ("preload", preload.preload, "Start vLLM's weight-cache daemons from a conversion.", preload.SETTINGS),
]

app = typer.Typer(
    name="megamoe", context_settings={"help_option_names": conventions.HELP_OPTIONS},
    help="Pre-bake MoE experts into DeepGEMM's MegaMoE per-rank layout, offline, so that the serving engine's "
         f"ranks load them with no transform work. Served: {engines_table.support_matrix()}.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: option names are never cut at 80 columns (CI logs)
)


def _print_version(requested: bool) -> None:
    """Eager, so that ``megamoe --version`` answers without a command."""
    if requested:
        print(f"megamoe-convert {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    invocation = _run.invocation()
    invocation.debug = invocation.debug or debug
    invocation.command = ctx.invoked_subcommand


for _name, _function, _summary, _settings in COMMANDS:
    app.command(_name, short_help=_summary, **_settings)(_function)
del _name, _function, _summary, _settings

