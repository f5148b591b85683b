"""The `megafuse` console script: one subcommand per tool, each with examples in --help."""

from __future__ import annotations

import argparse
import sys

from model.config import ConfigError

from . import info, run
from .output import console

TOOLS = {
    "info": (info, "parameter counts, cache sizes and the layer role table of a config"),
    "run": (run, "build a model, prefill a prompt, greedily decode and summarise"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megafuse", description="megafuse: fused DeepSeek-V4.1-Flash through torch.compile")
    sub = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    for name, (module, help_text) in TOOLS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=module.EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return TOOLS[args.tool][0].main(args)
    except (ConfigError, FileNotFoundError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
