"""The command line's conventions, applied to every command at once (``cli.main``):

- ``-h`` as well as ``--help``; ``-q/--quiet`` and ``--debug`` on every command;
- metavars that read like a usage line (``SRC OUT``, ``--ep-size N``), never a Python type;
- usage errors in plain words (the argument parser's validation messages are rewritten), and as
  JSON on stdout too when ``--json`` was asked for;
- what every command needs (torch, valid settings: :func:`._run.preflight`) checked once its
  arguments are parsed, before its own imports: ``-h`` needs neither;
- SIGTERM (``timeout``, Kubernetes) handled like Ctrl-C: the same clean stop and resume hint,
  exit 143 (Ctrl-C: 130).

Only typer's public names are used: every error of its argument parser derives from
``typer.TyperException``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import re
import sys
import textwrap
from typing import Any, Callable

import typer

from megamoe_convert import interrupts, ui
from megamoe_convert.cli import _run

HELP_OPTIONS = ["-h", "--help"]

#: Option metavars by parameter name (arguments get their name in capitals: SRC, OUT, REPO_ID).
OPTION_METAVARS = {
    "ep_size": "N", "num_redundant_experts": "R", "placement_file": "FILE", "device": "cpu|cuda", "workers": "K",
    "ranks": "RANKS", "layers": "LAYERS", "chunk_mb": "MB", "revision": "REV", "shard": "I/N",
    "shard_by": "layer|rank", "engine": "vllm|sglang", "source": "SRC", "sample": "K", "seed": "N",
    "preset": "NAME", "experts": "N", "mtp_layers": "N", "weight_format": "mxfp4|mxfp8|nvfp4|bf16",
    "weight_dtype": "int8|uint8|float4", "scale_dtype": "e8m0|uint8", "shard_mb": "MB", "local_dir": "DIR",
    "model": "OUT",
}
#: ``synth --layers`` is a count, ``convert --layers`` a selection.
COMMAND_METAVARS = {("synth", "layers"): "N"}
ARGUMENT_METAVARS = {"parts": "PART_DIR"}

def _set_quiet(ctx: Any, param: Any, value: bool) -> bool:
    if value:
        _run.invocation().quiet = True
        ui.set_quiet(True)
    return value


def _track_json(original: Any) -> Any:
    def callback(ctx: Any, param: Any, value: Any) -> Any:
        if value:
            _run.invocation().json = True
        return original(ctx, param, value) if original is not None else value
    return callback


def _plain_argument(param: Any, metavar: str) -> None:
    """``SRC`` in the usage line and the argument list (not ``{src}`` and ``src <str>``)."""
    param.metavar = metavar
    usage = (metavar if param.required else f"[{metavar}]") + ("..." if param.nargs != 1 else "")
    param._usage_display_name = lambda: usage
    param.display_type_rich = lambda ctx=None: ""


def _quiet_option(template: Any) -> Any:
    """``-q/--quiet``, made from one of the group's own flags (the parser's option class)."""
    quiet = copy.copy(template)
    quiet.name, quiet.opts, quiet.secondary_opts = "quiet", ["-q", "--quiet"], []
    quiet.help = "No progress or status lines (errors and --json output still appear)."
    quiet.callback, quiet.expose_value, quiet.is_eager = _set_quiet, False, True
    return quiet


def _set_debug(ctx: Any, param: Any, value: bool) -> bool:
    if value:
        _run.invocation().debug = True  # read by the one error path (``_run``), as the group's own --debug is
    return value


def _debug_option(template: Any) -> Any:
    """``--debug`` after the command too (``megamoe convert ... --debug``), as before it."""
    debug = copy.copy(template)
    debug.callback, debug.expose_value, debug.is_eager = _set_debug, False, True
    return debug


def examples_epilog(command: Any) -> None:
    """A command docstring's examples (after click's ``\\f``) as the ``Examples:`` section its ``--help``
    ends with, kept line for line (click's ``\\b``), before any epilog of its own."""
    head, marker, tail = inspect.cleandoc(command.help or "").partition("\f")
    if not marker:
        return
    body = textwrap.dedent(tail.strip().removeprefix("Examples::").removeprefix("Examples:").strip("\n"))
    examples = "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in body.splitlines() if line.strip())
    command.help = head.rstrip()
    command.epilog = examples + (f"\n\n{command.epilog}" if command.epilog else "")


def apply(group: Any) -> Any:
    """Apply the conventions to the whole command tree (once per process)."""
    template = next(p for p in group.params if p.name == "debug")
    for name, command in group.commands.items():
        command.context_settings = {**(command.context_settings or {}), "help_option_names": HELP_OPTIONS}
        examples_epilog(command)
        for param in command.params:
            if param.name == "as_json":
                param.callback = _track_json(param.callback)
            if getattr(param, "metavar", None) is not None:
                continue
            if getattr(param, "param_type_name", "") == "argument":
                _plain_argument(param, ARGUMENT_METAVARS.get(param.name or "", (param.name or "ARG").upper()))
            elif not getattr(param, "is_flag", False) and not getattr(param, "count", False):
                param.metavar = COMMAND_METAVARS.get((name, param.name or ""), OPTION_METAVARS.get(
                    param.name or "", (param.name or "VALUE").upper()))
        command.params.append(_quiet_option(template))
        if not any(p.name == "debug" for p in command.params):
            command.params.append(_debug_option(template))
        command.callback = _after_preflight(command.callback)
    return group


def _after_preflight(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback`` once :func:`._run.preflight` passed (one line and exit 2 where it does not): run
    after the arguments are parsed, so that ``-h`` and a usage error need no torch."""
    @functools.wraps(callback)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _run.run_command(_run.preflight)
        return callback(*args, **kwargs)
    return checked


#: The argument parser's validation wording, and what a user reads instead.
_REWRITES = [
    (re.compile(r"Value error, "), ""),
    (re.compile(r"Input should be greater than or equal to (\S+)"), r"must be at least \1"),
    (re.compile(r"Input should be less than or equal to (\S+)"), r"must be at most \1"),
    (re.compile(r"Input should be a valid integer.*"), "expected a whole number"),
    (re.compile(r"Input should be a valid number.*"), "expected a number"),
    (re.compile(r"Input should be (.*)"), r"expected \1"),
]


def plain_words(message: str) -> str:
    for pattern, replacement in _REWRITES:
        message = pattern.sub(replacement, message)
    return message


def json_requested(args: list[str]) -> bool:
    head = args[:args.index("--")] if "--" in args else args
    return _run.invocation().json or "--json" in head


def run(group: Any, args: list[str], prog_name: str) -> int:
    """Run the command line; returns the exit code. The command tree is invoked here, not through
    ``group.main``: that turns a stop (Ctrl-C, SIGTERM) raised while parsing or in a command before
    its body's error path (its deferred imports, say) into a bare exit 130 with nothing said."""
    _run.begin()
    try:
        with group.make_context(prog_name, list(args)) as ctx:
            result = group.invoke(ctx)
        interrupts.check()  # a stop recorded, not raised, in an import no command body ran
        return result if isinstance(result, int) else 0
    except typer.Exit as e:
        return int(getattr(e, "exit_code", 0) or 0)
    except typer.Abort as e:  # a prompt turns a stop (Ctrl-C, SIGTERM) into Abort: say which
        stop = e.__cause__ or e.__context__
        return _stopped(stop if isinstance(stop, KeyboardInterrupt) else KeyboardInterrupt())
    except KeyboardInterrupt as e:
        return _stopped(e)
    except typer.TyperException as e:  # the argument parser's: a usage error, a bad value, a file it cannot open
        return _parse_error(e, args)
    except BrokenPipeError:  # help or output into a closed pipe (``| head``): exit 1 and nothing more said
        _discard_closed_pipes()
        return 1


def _parse_error(e: typer.TyperException, args: list[str]) -> int:
    """The parser's error in plain words, with its usage line; as JSON too under ``--json``."""
    e.message = plain_words(e.message)
    show: Callable[[], None] | None = getattr(e, "show", None)
    if show is not None:
        show()
    else:
        print(f"Error: {e.format_message()}", file=sys.stderr)
    if json_requested(args):
        _run.print_json_error(e.format_message(), e.exit_code)
    return e.exit_code


def _discard_closed_pipes() -> None:
    """Point stdout and stderr at ``/dev/null`` where their pipe closed, as Python's documentation
    advises, so that the flush at exit raises nothing more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a stream with no file behind it, or one closed already
            continue
    os.close(devnull)


def _stopped(stop: KeyboardInterrupt) -> int:
    """A stop no command body caught (while parsing, say): one line, and its exit code."""
    return _run.say_stopped(interrupts.exit_code(stop))
