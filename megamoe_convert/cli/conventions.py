"""The command line's conventions, applied to every command at once (``cli.main``):

- ``-h`` as well as ``--help``; ``-q/--quiet`` on every command (no progress, no status lines);
- metavars that read like a usage line (``SRC OUT``, ``--ep-size N``), never a Python type;
- usage errors in plain words (the argument parser's validation messages are rewritten), and as
  JSON on stdout too when ``--json`` was asked for;
- SIGTERM (``timeout``, Kubernetes) handled like Ctrl-C: the same clean stop and resume hint,
  exit 143 (Ctrl-C: 130).
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import sys
import textwrap
from typing import Any

import typer
from typer._click import exceptions as click_exceptions
from typer._click import utils as click_utils

from megamoe_convert import interrupts, ui
from megamoe_convert.cli import signals

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

#: The state the conventions keep for the command running (read by ``_run.run_command``).
state: dict[str, Any] = {"json": False, "debug": False}


#: SIGTERM's exception and the handlers live in :mod:`.signals`, installed before anything else.
Terminated = signals.Terminated
install_signal_handlers = signals.install


def _set_quiet(ctx: Any, param: Any, value: bool) -> bool:
    if value:
        ui.set_quiet(True)
    return value


def _track_json(original: Any) -> Any:
    def callback(ctx: Any, param: Any, value: Any) -> Any:
        if value:
            state["json"] = True
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
        state["debug"] = True  # read by the one error path (``_run``) beside the group's own --debug
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
    return group


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
    return bool(state["json"]) or "--json" in head


def print_json_error(message: str, exit_code: int) -> None:
    sys.stdout.write(json.dumps({"ok": False, "error": message, "exit_code": exit_code}, indent=2) + "\n")


def run(group: Any, args: list[str], prog_name: str) -> int:
    """Run the command line; returns the exit code. The command tree is invoked here, not through
    ``group.main``: that turns a stop (Ctrl-C, SIGTERM) raised while parsing or in a command before
    its body's error path (its deferred imports, say) into a bare exit 130 with nothing said."""
    try:
        with group.make_context(prog_name, list(args)) as ctx:
            result = group.invoke(ctx)
        interrupts.check()  # a stop recorded, not raised, in an import no command body ran
        return result if isinstance(result, int) else 0
    except click_exceptions.UsageError as e:
        e.message = plain_words(e.message)
        e.show()
        if json_requested(args):
            print_json_error(f"{e.format_message()}", e.exit_code)
        return e.exit_code
    except typer.Exit as e:
        return int(getattr(e, "exit_code", 0) or 0)
    except typer.Abort as e:  # a prompt turns a stop (Ctrl-C, SIGTERM) into Abort: say which
        stop = e.__cause__ or e.__context__
        return _stopped(stop if isinstance(stop, KeyboardInterrupt) else KeyboardInterrupt())
    except KeyboardInterrupt as e:
        return _stopped(e)
    except click_exceptions.ClickException as e:
        e.show()
        return e.exit_code
    except BrokenPipeError:  # help or output into a closed pipe (``| head``): exit 1 and nothing more said
        sys.stdout = click_utils.PacifyFlushWrapper(sys.stdout)
        sys.stderr = click_utils.PacifyFlushWrapper(sys.stderr)
        return 1


def _stopped(stop: KeyboardInterrupt) -> int:
    """A stop no command body caught (while parsing, say): one line, and its exit code."""
    code = signals.exit_code(stop)
    print(f"{signals.what(code)}: rerun the same command", file=sys.stderr)
    if state["json"]:
        print_json_error(f"{signals.what(code)}: rerun the same command", code)
    return code
