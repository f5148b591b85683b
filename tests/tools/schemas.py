"""The JSON schemas the tools document in docs/tools.md, for the tests that check a tool writes
exactly what is documented."""

import re
from pathlib import Path

TOOLS_DOC = Path(__file__).resolve().parents[2] / "docs" / "tools.md"


def documented_schema(schema: str) -> str:
    """The documented block of `schema` ("megafuse.run/2"): the code block under its heading (a
    `megafuse` command's, or a benchmark module's such as `python3 -m megafuse.tools.bench_decode`)."""
    match = re.search(rf"^## `[^`]+`: `{re.escape(schema)}`\n\n```\n(.*?)```", TOOLS_DOC.read_text(),
                      flags=re.S | re.M)
    assert match, f"{schema} is not documented in {TOOLS_DOC}"
    return match.group(1)
