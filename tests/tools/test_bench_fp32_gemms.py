"""bench_fp32_gemms: the splits are what they claim (hypothesis against the fp32 value), each variant's
error against an fp64 product of the same operands keeps to its format's bound, and the dry run
writes the documented JSON."""

import json
import re

import torch
from hypothesis import given, settings, strategies as st

from megafuse.model import preset
from megafuse.tools.bench_fp32_gemms import SCHEMA, main, operands, split_bf16, variant_fn
from tests.tools.schemas import documented_schema

U_FP32 = 2.0 ** -24

normal_fp32 = st.floats(min_value=2.0 ** -100, max_value=2.0 ** 100, width=32)


@settings(max_examples=300, deadline=None)
@given(st.lists(normal_fp32, min_size=1, max_size=16), st.lists(st.booleans(), min_size=16, max_size=16))
def test_three_bf16_parts_sum_to_the_fp32_value_exactly_and_two_hold_sixteen_bits(magnitudes, signs):
    x = torch.tensor([m if s else -m for m, s in zip(magnitudes, signs)], dtype=torch.float32)
    parts = split_bf16(x, 3)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    exact = sum(p.double() for p in parts)
    assert torch.equal(exact, x.double())  # 3 x 8 significant bits hold fp32's 24
    hi, lo = split_bf16(x)
    # each rounding is within 2^-9 relative; the second rounds a remainder of at most 2^-9 |x|
    assert ((hi.double() + lo.double() - x.double()).abs() <= 2.0 ** -17 * x.double().abs()).all()


def _errors(name: str, cfg, T: int, context: int) -> dict:
    a, b = operands(name, cfg, T, context, torch.Generator().manual_seed(7))
    exact = a.double() @ b.double().t()
    out = {}
    for variant in ("fp32", "bf16x3", "bf16", "bf16_w3"):
        got = variant_fn(variant, a, b, b_is_weight=name == "compressor")()
        assert got.dtype == torch.float32 and got.shape == exact.shape
        out[variant] = ((got.double() - exact).norm() / exact.norm()).item()
    return out


def test_the_compressor_keeps_fp32_only_with_the_weight_in_three_parts():
    """flash-lite's widths, K = 5120: fp32 and bf16_w3 form the exact products and sum them in fp32
    (a random walk of K roundings: within 4 sqrt(K) u); bf16 x3 keeps about 16 bits of the weight,
    bf16 8, so their errors sit near 2^-17 and 2^-9 and far above fp32's."""
    cfg = preset("flash-lite")
    e = _errors("compressor", cfg, 4, 64)
    bound = 4 * cfg.dim ** 0.5 * U_FP32
    assert e["fp32"] <= bound and e["bf16_w3"] <= bound, e
    assert 2.0 ** -20 <= e["bf16x3"] <= 2.0 ** -14, e
    assert 2.0 ** -12 <= e["bf16"] <= 2.0 ** -7, e


def test_the_indexer_operands_are_bf16_values_so_bf16_is_as_exact_as_fp32():
    cfg = preset("flash-lite")
    a, b = operands("indexer", cfg, 2, 256, torch.Generator().manual_seed(3))
    assert torch.equal(a, a.bfloat16().float()) and torch.equal(b, b.bfloat16().float())
    e = _errors("indexer", cfg, 2, 256)
    bound = 4 * cfg.index_head_dim ** 0.5 * U_FP32
    assert all(v <= bound for v in e.values()), e


def test_the_dry_run_writes_the_documented_fields(tmp_path):
    out = tmp_path / "gemms.json"
    assert main(["--config", "tiny", "--context", "64", "--tokens", "1,4", "--dry-run", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == SCHEMA and r["dry_run"] and r["tokens"] == [1, 4]
    doc = documented_schema(SCHEMA)
    for key in r:
        assert re.search(rf"^{key}\b|, {key}\b", doc, flags=re.M), f"{key} is not documented"
    assert set(r["gemms"]) == {"compressor_T1", "compressor_T4", "indexer_T1", "indexer_T4"}
    compressor, indexer = r["gemms"]["compressor_T4"], r["gemms"]["indexer_T4"]
    assert not compressor["exact_in_bf16"] and indexer["exact_in_bf16"]
    assert set(compressor["variants"]) == {"fp32", "bf16x3", "bf16", "bf16_w3"}  # no TF32 on the CPU
    assert [v for v, row in compressor["variants"].items() if row["within_release"]] == ["fp32", "bf16_w3"]
    assert all(row["within_release"] and row["us"] is None for row in indexer["variants"].values())
