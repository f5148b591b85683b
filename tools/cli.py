"""The `megafuse` console script: one subcommand per tool, each with examples in --help.

Exit status (every tool): 0 success; 1 a check failed (logits beyond --tolerance); 2 a usage or
configuration error, which names the valid choices: an unknown tool, preset, pass, flag or choice,
a config rule broken, a request that cannot fit; 3 an internal error (a bug: the message says how
to get the traceback). Errors and progress go to stderr as `megafuse <tool>: ...`; results to
stdout.

`megafuse --help` and an unknown tool answer without importing torch: a tool's module (and torch,
Inductor, Triton) is imported only once the tool is known.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
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
    return argparse.ArgumentParser(prog="megafuse", description=DESCRIPTION, epilog=EPILOG)


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    tool = _tool_of(argv)
    _log_progress(tool)
    parser = build_parser([tool])
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_flags(parser, args.tool, extras)  # exits with status 2
    from megafuse.model.config import ConfigError  # (imports torch: only now)
    from .output import ToolError
    try:
        return importlib.import_module(TOOLS[tool][0]).main(args)
    except (ConfigError, ToolError, FileNotFoundError) as e:
        print(f"megafuse {tool}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a bug: one line, and the traceback on request
        if os.environ.get(TRACEBACK_ENV):
            traceback.print_exc()
        print(f"megafuse {tool}: internal error: {type(e).__name__}: {e}\n"
              f"(a bug in megafuse; {TRACEBACK_ENV}=1 prints the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
