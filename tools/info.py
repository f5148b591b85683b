"""`megafuse info`: parameter counts, cache sizes and the per-layer role table of a config."""

from __future__ import annotations

import argparse

from rich.table import Table

from megafuse.model.config import PRESETS, resolve_config
from megafuse.model.stats import summary

from .output import console, write_json

EXAMPLES = """examples:
  megafuse info --config flash
  megafuse info --config flash --json -          # the same facts as JSON on stdout
  megafuse info --config my_config.json --json info.json
"""

PUBLISHED_PARAMETERS = {"flash": 552e9}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help=f"a preset ({', '.join(PRESETS)}), a config JSON or a checkpoint directory")
    parser.add_argument("--json", metavar="PATH", help="also write the facts as JSON ('-' for stdout)")


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e8 else f"{n / 1e6:,.2f}M"


def main(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config)
    facts = summary(cfg)
    published = PUBLISHED_PARAMETERS.get(cfg.name)
    if published:
        facts["published_parameters"] = published
        facts["backbone_vs_published"] = facts["parameters"]["backbone"] / published
    if cfg.extra:
        facts["ignored_config_fields"] = dict(sorted(cfg.extra.items()))  # field -> why the model ignores it
    if args.json == "-":
        write_json(facts, "-")
        return 0

    p = facts["parameters"]
    summary_table = Table(title=f"config {cfg.name}", show_header=False)
    summary_table.add_row("backbone parameters", _billions(p["backbone"])
                          + (f"  ({facts['backbone_vs_published']:.3f} x the published {published / 1e9:.0f}B)" if published else ""))
    summary_table.add_row("Engram tables (host memory)", _billions(p["engram_tables"]))
    summary_table.add_row("weights on the GPU", f"{facts['device_parameter_bytes'] / 2**30:.1f} GiB")
    summary_table.add_row("routed experts", _billions(p["routed_experts"]))
    summary_table.add_row("activated per token", _billions(p["activated_per_token"]))
    summary_table.add_row("global KV bytes / token", f"{facts['global_kv_bytes_per_token']:g}")
    summary_table.add_row("SWA bytes / request", f"{facts['swa_bytes_per_request']:,}")
    console.print(summary_table)

    roles = Table(title="layer roles")
    for col in ("layer", "part", "role", "ratio", "kv source", "top-k source", "candidates", "engram"):
        roles.add_column(col)
    for r in facts["roles"]:
        roles.add_row(str(r["layer"]), r["part"], r["role"], str(r["ratio"]),
                      "-" if r["kv_source"] is None else str(r["kv_source"]),
                      "-" if r["topk_source"] is None else str(r["topk_source"]),
                      "yes" if r["candidates"] else "", "yes" if r["engram"] else "")
    console.print(roles)
    if cfg.extra:
        ignored = Table(title="config fields the model ignores")
        for col in ("field", "why"):
            ignored.add_column(col)
        for key, why in facts["ignored_config_fields"].items():
            ignored.add_row(key, why)
        console.print(ignored)
    if args.json:
        write_json(facts, args.json)
    return 0
