"""Shared output helpers of the tools: one rich console, JSON writing with run metadata."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch
from rich.console import Console

# Tables are wide: a log or a pipe (no terminal, no COLUMNS) gets 120 columns rather than rich's 80.
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
# Progress (tools.common.step) and the megafuse.* log go to stderr: stdout keeps the results.
progress_console = Console(stderr=True, width=None if sys.stderr.isatty() or os.environ.get("COLUMNS") else 120)
# What every progress line starts with: `megafuse <tool>` once the command line knows the tool.
progress_prefix = "megafuse"


def _triton_version() -> str:
    """Without importing Triton where its distribution says (`info` imports none of the compiler)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # another distribution name (e.g. pytorch-triton)
        import triton
        return triton.__version__


class ToolError(Exception):
    """A usage error found after parsing (no CUDA, a layer out of range, an unknown kernel name):
    the command line prints it and exits with status 2, like argparse."""


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }


@contextlib.contextmanager
def tables_to_stderr(active: bool):
    """While `--json -` writes JSON to stdout, send the tables and progress to stderr."""
    previous = console.stderr
    console.stderr = previous or active
    try:
        yield
    finally:
        console.stderr = previous


def write_json(data: dict, path: str) -> None:
    text = json.dumps(data, indent=2, default=str) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        console.print(f"wrote {path}")
