"""Mega-mHC on generated spellings: one seam written in any of many equivalent ways fuses whole,
exactly once, and equals the eager chain in its own dtypes; a spelling that changes the seam's
maths leaves the changed part unfused, and the report says why.

The spellings (tests/passes/mhc_spellings.py) are drawn by hypothesis from discrete choices,
derandomized, so CI runs the same ones every time; each runs through Dynamo, AOT autograd and
Inductor's real post-grad passes with the generated kernels (tests/passes/post_grad.fuse: no C++
code generation, about a second a seam).
"""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.passes.mhc_spellings import (CHOICES, FORMS, LEADS, NEAR_MISSES, PARAM_DTYPES, STREAM_DTYPES,
                                        SpelledSeam, Spelling)
from tests.passes.post_grad import fuse

# What is left of a fused seam's graph: nothing that computes (the parameters' widening converts
# and the outputs' getitems only).
COMPUTE = ("aten.mm", "aten.bmm", "aten.rsqrt", "aten.reciprocal", "aten.sigmoid", "aten.exp", "aten.sum",
           "aten.mean", "aten.pow", "aten.div", "aten.mul", "aten.add")
# Generate, never shrink: a failure names its whole spelling, and shrinking one re-runs a seam per step.
FIND = (Phase.explicit, Phase.generate)


def spellings(forms=FORMS, **fixed) -> st.SearchStrategy:
    """Seams of `forms` in any spelling, token count and dtypes; `fixed`: field -> its choices."""
    fields = {"form": forms, "T": (1, 3, 8), "lead": LEADS, "stream_dtype": STREAM_DTYPES, "hc_dtype": PARAM_DTYPES,
              "norm_dtype": PARAM_DTYPES, "iters": (1, 3, 20), **CHOICES, **fixed}
    return st.builds(Spelling, **{name: st.sampled_from(choices) for name, choices in fields.items()})


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_seam(spelling: Spelling):
    """The seam fused (passes: mega_mhc) and run; asserts its outputs equal the eager chain's
    (same dtypes and shapes; relative L2 <= 1e-5 with fp32 streams, 1e-2 with bf16 / fp16)."""
    module = SpelledSeam(spelling)
    args = module.inputs()
    with torch.no_grad():
        fused = fuse(module, ["mega_mhc"], fullgraph=True)
        out, want = fused(*args), module(*args)
    tol = 1e-5 if spelling.stream_dtype == "float32" else 1e-2
    assert len(out) == len(want)
    for got, ref in zip(out, want):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert _rel(got, ref) <= tol, (_rel(got, ref), spelling)
    return fused


def check_fused_whole(spelling: Spelling) -> dict:
    """Asserts `spelling` fuses whole, once, and equals the chain; the fused op's spec."""
    fused = run_seam(spelling)
    report = fused.report
    assert report.counts() == {"mega_mhc": 1}, (report.rejections("mega_mhc"), spelling)
    spec = report.matches("mega_mhc")[0].spec
    assert spec["has_post"] == spelling.has_post and spec["has_coefficients"] == spelling.has_head, spec
    assert spec["pre"] == ("fresh" if spelling.form == "fresh" else "carried")
    assert spec["stream_dtype"] == spelling.stream_dtype
    if spelling.has_head:
        assert spec["sinkhorn_iters"] == spelling.iters and spec["hc_eps"] == 1e-6
    # whole: the only note a whole seam carries is the first seam's (it has no post to take)
    assert "left_unfused" not in spec or (spelling.form == "first" and "first seam" in spec["left_unfused"][0])
    after = fused.post_grad_graphs[0]
    assert not [op for op in COMPUTE if op + "." in after], after
    return spec


def check_near_miss(spelling: Spelling) -> None:
    near = NEAR_MISSES[spelling.near_miss]
    fused = run_seam(spelling)
    report = fused.report
    specs = [m.spec for m in report.matches("mega_mhc")]
    if near.part == "collapse":  # every form needs its collapse + norm: nothing fuses
        assert specs == []
    else:
        key = "has_post" if near.part == "post" else "has_coefficients"
        assert not any(s[key] for s in specs), specs
    reasons = [r.reason for r in report.rejections("mega_mhc")] + [n for s in specs for n in s.get("left_unfused", [])]
    assert any(near.reason in r for r in reasons), (reasons, spelling)


def _fused_spellings(examples: int) -> set:
    seen = set()

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None, phases=FIND,
              suppress_health_check=list(HealthCheck))
    @given(spellings())
    def check(spelling):
        check_fused_whole(spelling)
        seen.add(spelling.key())

    check()
    return seen


def _near_misses(examples: int) -> dict:
    refused = {}
    for name, near in NEAR_MISSES.items():
        @settings(max_examples=examples, derandomize=True, deadline=None, database=None, phases=FIND,
                  suppress_health_check=list(HealthCheck))
        @given(spellings(near.forms, **near.fixed))
        def check(spelling):
            spelling = dataclasses.replace(spelling, near_miss=name)  # noqa: B023 (run at once)
            check_near_miss(spelling)
            refused.setdefault(name, set()).add(spelling.key())  # noqa: B023

        check()
    return refused


@pytest.mark.slow
def test_equivalent_spellings_fuse_whole_once_and_equal_the_chain():
    assert len(_fused_spellings(80)) >= 50  # (80 draws give 74 distinct seams)


def test_spellings_that_change_the_maths_are_refused_with_their_reason():
    refused = _near_misses(2)
    assert len(refused) >= 10 and sum(map(len, refused.values())) >= 20


@pytest.mark.exhaustive
def test_many_more_equivalent_spellings_fuse_whole():
    assert len(_fused_spellings(600)) >= 500


@pytest.mark.exhaustive
def test_many_more_near_misses_are_refused():
    refused = _near_misses(12)
    assert len(refused) == len(NEAR_MISSES) and sum(map(len, refused.values())) >= 8 * len(NEAR_MISSES)


# ---- spellings every run checks, whatever hypothesis draws ------------------------------------

EXTERNAL = Spelling(mix="transpose_matmul", gate="unsqueeze", post_add="mix_first", parts="slices",
                    base_parts="slices", collapse="index_none", softmax="softmax", sinkhorn="loop")


@pytest.mark.parametrize("T", [1, 3, 8])
def test_the_external_spelling_fuses_whole_at_every_token_count(T):
    # docs/model.md section 3 as a reader writes it: C^T X by transpose and @, the
    # coefficients' parts by slicing, Sinkhorn as a loop. On the H200 this fused only post +
    # collapse (the sliced head unfused, no reason) and at T=1 nothing (Inductor drops size-1 dims).
    check_fused_whole(dataclasses.replace(EXTERNAL, T=T))


HF = Spelling(form="fresh", mix="transpose_matmul", r_at="before", projection="linear", comb_shape_at="before_affine",
              scale_read="unbind", norm="w_first", lead="2T")


@pytest.mark.parametrize("stream_dtype", STREAM_DTYPES)
@pytest.mark.parametrize("hc_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("norm_dtype", PARAM_DTYPES)
def test_every_dtype_combination_fuses_and_equals_the_chain_in_its_dtypes(stream_dtype, hc_dtype, norm_dtype):
    # fp32 / bf16 / fp16 streams with fp32 or bf16 parameters, as a model cast or loaded that way
    # has them: bf16 parameters are widened by the rewrite (exact); the kernel rounds X', c and u
    # to the stream dtype where the chain does
    for form in ("delayed", "fresh"):
        check_fused_whole(dataclasses.replace(HF if form == "fresh" else EXTERNAL, form=form,
                                              stream_dtype=stream_dtype, hc_dtype=hc_dtype, norm_dtype=norm_dtype))


@pytest.mark.parametrize("norm_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("stream_dtype", STREAM_DTYPES)
def test_a_llama_style_norm_fuses_with_its_roundings(stream_dtype, norm_dtype):
    # `weight * x.to(input_dtype)` (HF's Llama-family RMSNorm, and DeepseekV4's in older
    # transformers): x rounded before the weight multiplies; the spec says so for 16-bit streams
    for form in ("delayed", "final"):
        spelling = dataclasses.replace(EXTERNAL, form=form, norm="llama", stream_dtype=stream_dtype,
                                       norm_dtype=norm_dtype, param_upcast="promote")
        spec = check_fused_whole(spelling)
        assert spec["norm_rounding"] == ("once" if stream_dtype == "float32" else "twice"), spec


def test_an_unsupported_stream_dtype_is_refused_at_compile_time_with_the_reason():
    # fp64 streams: the chain reads them rounded to fp32, which the kernel does not do
    fused = run_seam(dataclasses.replace(EXTERNAL, stream_dtype="float64", hc_dtype="float64", norm_dtype="float64"))
    assert fused.report.counts() == {"mega_mhc": 0}
    (rejection,) = fused.report.rejections("mega_mhc")
    assert "stream rounded from float64 to float32" in rejection.reason, rejection.reason


def test_a_seam_whose_head_does_not_match_fuses_post_and_collapse_and_says_so():
    # whole chains, or a reason: the head (Sinkhorn ending on rows) is refused at its projection,
    # and the post + collapse that do match fuse as a partial seam whose note names the head's reason
    fused = run_seam(dataclasses.replace(EXTERNAL, near_miss="sinkhorn_ends_on_rows"))
    (match,) = fused.report.matches("mega_mhc")
    assert match.spec["has_post"] and not match.spec["has_coefficients"]
    assert match.spec["left_unfused"] == ["the coefficient head reading X' stays unfused: Sinkhorn does not end on "
                                          "a column normalisation"]
    (rejection,) = fused.report.rejections("mega_mhc")
    assert rejection.reason == "Sinkhorn does not end on a column normalisation"


def test_a_head_without_its_collapse_is_a_rejection_with_the_reason_not_silence():
    fused = run_seam(dataclasses.replace(EXTERNAL, form="first", near_miss="norm_mean_over_tokens"))
    assert fused.report.counts() == {"mega_mhc": 0}
    (rejection,) = fused.report.rejections("mega_mhc")
    assert rejection.reason.startswith("no hc_pre + RMSNorm reads the stream of this coefficient head: "), rejection
    assert "the RMS statistic's mean runs over dims [0], not the last dim" in rejection.reason
