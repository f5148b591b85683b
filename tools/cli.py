"""The `megafuse` console script: one subcommand per tool, each with examples in --help.

Exit status (every tool): 0 success; 1 a check failed (logits beyond --tolerance); 2 a usage or
configuration error, which names the valid choices: an unknown tool, preset, pass, flag or choice,
a config rule broken, a request that cannot fit; 3 an internal error (a bug: the message says how
to get the traceback; or an entry of Inductor's cache that did not load, which the message names,
removed, with the command that clears the cache); 130 interrupted (Ctrl-C), after one line. Errors
and progress go to stderr as `megafuse <tool>: ...`; results to stdout.

`megafuse --help` and an unknown tool answer without importing torch: a tool's module (and torch,
Inductor, Triton) is imported only once the tool is known.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.metadata
import logging
import os
import signal
import sys
import threading
import time
import traceback

# name -> (module, one line); the module is imported when the tool runs or shows its own --help
TOOLS = {
    "info": ("megafuse.tools.info", "parameter counts, cache sizes and the layer role table of a config"),
    "run": ("megafuse.tools.run", "compile the batched step with the passes, prefill + incremental decode, compare with eager"),
    "generate": ("megafuse.tools.generate", "token-id prompts in, token ids out, through the serving engine"),
    "bench-serve": ("megafuse.tools.bench_serve", "the agentic workload through the engine, per configuration: TTFT, throughput"),
    "ablate": ("megafuse.tools.ablate", "every pass alone, all but each, all and none: matches, kernels, latency, error"),
    "inspect": ("megafuse.tools.inspect_kernels", "list the fused kernels of a compiled model or layer: pass, spec, source, metadata"),
}
EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERNAL = 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
TRACEBACK_ENV = "MEGAFUSE_TRACEBACK"
DESCRIPTION = "megafuse: fused DeepSeek-V4.1-Flash through torch.compile"
EPILOG = (f"exit status: 0 success, {EXIT_CHECK_FAILED} a check failed (e.g. logits beyond --tolerance), "
          f"{EXIT_USAGE} a usage or configuration error, {EXIT_INTERNAL} an internal error "
          f"({TRACEBACK_ENV}=1 prints its traceback)")


def build_parser(tools=TOOLS) -> argparse.ArgumentParser:
    """The whole command line, with the given tools' subcommands (importing their modules)."""
    parser = _top_parser()
    sub = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    for name in tools:
        module, help_text = importlib.import_module(TOOLS[name][0]), TOOLS[name][1]
        # allow_abbrev=False: a mistyped --no-<pass> is an error, never a silent prefix match
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=module.EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        module.add_arguments(p)
    return parser


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megafuse", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"megafuse {importlib.metadata.version('megafuse')}")
    return parser


def _tool_of(argv: list[str]) -> str:
    """The tool argv names, found without importing any tool: top-level --help and an unknown or
    missing tool are answered (and exit) here."""
    parser = _top_parser()
    sub = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    for name, (_, help_text) in TOOLS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args, _ = parser.parse_known_args(argv)
    return args.tool


def _unknown_flags(parser: argparse.ArgumentParser, tool: str, extras: list[str]) -> None:
    """argparse's 'unrecognized arguments' plus the valid options of the tool (closest first)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[tool]
    options = {s for a in sub._actions for s in a.option_strings}
    # --no-<pass> has a dashed and an underscored spelling: list the dashed one
    options = sorted(o for o in options if not ("_" in o and o.replace("_", "-") in options))
    close = [m for e in extras if e.startswith("-") for m in difflib.get_close_matches(e.split("=")[0], options, n=3)]
    hint = f"; did you mean {', '.join(dict.fromkeys(close))}?" if close else ""
    sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}\nvalid options: {', '.join(options)}")


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record comes, not the stream of the first
    call (main() runs many times in one process under tests, each with its own captured stderr)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _log_progress(tool: str) -> None:
    """The megafuse.* log (each graph's passes and compile time) as `megafuse <tool>: ...` lines on
    stderr where stderr is a log, not a terminal (there the spinner shows the progress)."""
    logger = logging.getLogger("megafuse")
    if not logger.handlers and not sys.stderr.isatty():
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"megafuse {tool}: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


INTERRUPT_GRACE_S = 2.5  # after a Ctrl-C, the longest the unwinding may take before the command leaves anyway
_leaving = threading.Lock()


def _leave_interrupted(tool: str) -> None:
    """The end of an interrupted command: remove the builds the interrupt cut short, print the one
    line, exit 130 at once. os._exit, because a normal exit would first wait for Inductor's compile
    threads to run every queued C++ build (tens of seconds). The first caller leaves; another one
    (the watchdog, the main thread) waits for it."""
    if not _leaving.acquire(blocking=False):
        threading.Event().wait()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not turn the exit into a traceback
    removed = []
    if "megafuse.passes" in sys.modules:
        with contextlib.suppress(Exception):  # the next compiling run repairs what this misses
            from megafuse.passes import inductor_cache
            # the linker a Ctrl-C killed left its output empty or short: gone before the next run
            removed = inductor_cache.repair(budget_s=1.5)
    plural = "s" * (len(removed) != 1)
    note = f" (removed {len(removed)} unfinished build{plural} from Inductor's cache)" if removed else ""
    with contextlib.suppress(Exception):  # stderr may be a closed pipe
        print(f"megafuse {tool}: interrupted{note}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _on_ctrl_c(tool: str):
    """The command's SIGINT handler: KeyboardInterrupt, as Python's own, so that context managers
    unwind (the spinner, the ranks of --world-size). The first Ctrl-C also makes the exit certain:
    Python prints and drops a KeyboardInterrupt raised inside a finalizer or weakref callback
    (Dynamo runs many), and a long C call holds it back; so a KeyboardInterrupt that reaches
    sys.unraisablehook leaves at once, and a watchdog leaves INTERRUPT_GRACE_S later."""
    armed = False

    def watchdog():
        time.sleep(INTERRUPT_GRACE_S)
        _leave_interrupted(tool)

    def on_sigint(signum, frame):
        nonlocal armed
        if not armed:
            armed = True
            threading.Thread(target=watchdog, name="megafuse-interrupt-watchdog", daemon=True).start()
            previous = sys.unraisablehook

            def unraisable(info):
                if isinstance(info.exc_value, KeyboardInterrupt):
                    _leave_interrupted(tool)
                previous(info)

            sys.unraisablehook = unraisable
        raise KeyboardInterrupt

    return on_sigint


def main(argv: list[str] | None = None) -> int:
    """Run the tool argv names; return its exit status (the module docstring's).

    A tool that compiles (its module imported megafuse.passes) first removes the entries of
    Inductor's cache that an interrupted build left unfinished, one line each
    (passes/inductor_cache.py); a load failure over a cache file removes that file and names the
    command that clears the cache.

    Ctrl-C (SIGINT) at any moment prints `megafuse <tool>: interrupted` and nothing else. Run as the
    command (argv None), main installs `_on_ctrl_c`'s handler, and the process removes the builds
    the interrupt cut short and leaves with status 130 within INTERRUPT_GRACE_S plus that repair
    (`_leave_interrupted`). Called with argv (tests, in process), main installs nothing and the
    KeyboardInterrupt goes on to the caller after the line. Importing this module or megafuse.passes
    installs nothing either: library users of passes.compile keep Python's own handler.
    """
    own_process = argv is None  # the console script: this process is the command's, and ends with it
    argv = sys.argv[1:] if argv is None else list(argv)
    tool = _tool_of(argv)
    if own_process:
        signal.signal(signal.SIGINT, _on_ctrl_c(tool))
    try:
        _log_progress(tool)
        parser = build_parser([tool])
        args, extras = parser.parse_known_args(argv)
        if extras:
            _unknown_flags(parser, args.tool, extras)  # exits with status 2
        from megafuse.model.config import ConfigError  # (imports torch: only now)
        from . import output
        from .output import ToolError
        output.progress_prefix = f"megafuse {tool}"
        compiles = "megafuse.passes" in sys.modules  # the tool's module imported the compiler
        if compiles:
            from megafuse.passes import inductor_cache
            for entry in inductor_cache.repair_once():  # else each would fail its compile, every run
                print(f"megafuse {tool}: removed a broken entry of Inductor's cache, built again when needed: "
                      f"{entry}", file=sys.stderr)
        try:
            return importlib.import_module(TOOLS[tool][0]).main(args)
        except (ConfigError, ToolError, FileNotFoundError) as e:
            print(f"megafuse {tool}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as e:  # a bug: one line, and the traceback on request
            if os.environ.get(TRACEBACK_ENV):
                traceback.print_exc()
            # a cache file that passed the checks and still failed to load: not a bug of megafuse's
            if compiles and (broken := inductor_cache.remove_named_in(e)):
                print(f"megafuse {tool}: error: removed entries of Inductor's cache that did not load: "
                      f"{', '.join(map(str, broken))}; run the command again (or clear the whole cache: "
                      f"{inductor_cache.clear_command()})", file=sys.stderr)
                return EXIT_INTERNAL
            print(f"megafuse {tool}: internal error: {type(e).__name__}: {e}\n"
                  f"(a bug in megafuse; {TRACEBACK_ENV}=1 prints the traceback)", file=sys.stderr)
            return EXIT_INTERNAL
    except KeyboardInterrupt:
        if not own_process:
            print(f"megafuse {tool}: interrupted", file=sys.stderr)
            raise
        _leave_interrupted(tool)


if __name__ == "__main__":
    sys.exit(main())
