"""The `megafuse` console script: one subcommand per tool, each with examples in --help.

Usage errors exit with status 2 and name the valid choices: an unknown preset (from the config
loader), an unknown pass (from the registry, through `--passes`), an unknown flag (the tool's
options, with the closest ones first), a bad choice (argparse lists them).
"""

from __future__ import annotations

import argparse
import difflib
import sys

from model.config import ConfigError

from . import ablate, info, inspect_kernels, run
from .common import ToolError
from .output import console

TOOLS = {
    "info": (info, "parameter counts, cache sizes and the layer role table of a config"),
    "run": (run, "compile with the passes, prefill + greedy decode, compare with eager"),
    "ablate": (ablate, "every pass alone, all but each, all and none: matches, kernels, latency, error"),
    "inspect": (inspect_kernels, "list the fused kernels of a compiled model or layer: pass, spec, source, metadata"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megafuse", description="megafuse: fused DeepSeek-V4.1-Flash through torch.compile")
    sub = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    for name, (module, help_text) in TOOLS.items():
        # allow_abbrev=False: a mistyped --no-<pass> is an error, never a silent prefix match
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=module.EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        module.add_arguments(p)
    return parser


def _unknown_flags(parser: argparse.ArgumentParser, tool: str, extras: list[str]) -> None:
    """argparse's 'unrecognized arguments' plus the valid options of the tool (closest first)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[tool]
    options = {s for a in sub._actions for s in a.option_strings}
    # --no-<pass> has a dashed and an underscored spelling: list the dashed one
    options = sorted(o for o in options if not ("_" in o and o.replace("_", "-") in options))
    close = [m for e in extras if e.startswith("-") for m in difflib.get_close_matches(e.split("=")[0], options, n=3)]
    hint = f"; did you mean {', '.join(dict.fromkeys(close))}?" if close else ""
    sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}\nvalid options: {', '.join(options)}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_flags(parser, args.tool, extras)  # exits with status 2
    try:
        return TOOLS[args.tool][0].main(args)
    except (ConfigError, ToolError, FileNotFoundError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
