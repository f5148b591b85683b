"""Mega-Indexer's kernels against the model's step (decode, index_scores, select_topk) and an fp64
top-k written here: random keys in every cache format, fp32 and bf16 queries, exact ties, rows that see fewer than K
entries, pages in any order, negative scores."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megafuse.lowering.mega_indexer import IndexerSpec, LaunchConfig, mega_indexer, reference, select, unsupported_reason
from megafuse.model import quant
from megafuse.model.attention import select_topk


def _case(q_dtype: str, fmt="index_mxfp4", *, H=4, D=32, K=6, ratio=2, per_page=8, R=5, max_pages=4, pool_pages=30, seed=0,
          positions=(0, 1, 5, 40, 63)):
    g = torch.Generator().manual_seed(seed)
    spec = IndexerSpec(heads=H, head_dim=D, topk=K, ratio=ratio, per_page=per_page, key_format=fmt, q_dtype=q_dtype)
    pool = spec.codec().encode(torch.randn(pool_pages, per_page, D, generator=g))
    pages = torch.randperm(pool_pages, generator=g)[: R * max_pages].view(R, max_pages)
    q = torch.randn(R, H, D, generator=g)
    if fmt == "index_mxfp4":
        q = quant.fake_quant_index_mxfp4(q)  # the model rounds its queries so too under quant "ref"
    q = q.to(getattr(torch, q_dtype))
    w = torch.randn(R, H, generator=g)  # negative weights: negative scores too
    return spec, (q, w, pool, pages, torch.tensor(positions[:R]), None)


def fp64_topk(q, w, pool, pages, positions, allowed, spec):
    """Written here, in fp64: the decoded keys, sum_h w relu(q . k), the visible entries' K largest
    (ties to the lowest entry), ascending, -1 padded; with the gap between the K-th and the next score
    (0 for an exact tie, which both break to the lowest entry; a tiny one would be a near tie)."""
    keys = spec.codec().decode(pool[pages].flatten(1, 2), torch.float64)  # [R, N, d]
    scores = (w.double()[:, :, None] * torch.einsum("rhd,rnd->rhn", q.double(), keys).clamp(min=0)).sum(1)
    out, gaps = [], []
    for r in range(q.shape[0]):
        n_visible = min((int(positions[r]) + 1) // spec.ratio, keys.shape[1])
        selectable = [n for n in range(n_visible) if allowed is None or allowed[r, n]]
        order = sorted(selectable, key=lambda n: (-scores[r, n].item(), n))
        chosen = sorted(order[: spec.topk])
        out.append(chosen + [-1] * (spec.topk - len(chosen)))
        if len(selectable) > spec.topk:
            gaps.append(abs(scores[r, order[spec.topk - 1]] - scores[r, order[spec.topk]]).item())
    return torch.tensor(out), gaps


@pytest.mark.parametrize("q_dtype, fmt", [("float32", "index_mxfp4"), ("bfloat16", "index_mxfp4"),
                                          ("float32", "float32"), ("bfloat16", "bfloat16")])
def test_the_kernels_choose_what_the_model_chooses(q_dtype, fmt):
    spec, args = _case(q_dtype, fmt)
    got, scores = mega_indexer(*args, spec)
    assert got.dtype == torch.int64 and got.shape == (5, 6)
    ref, ref_scores = reference(*args, spec)
    assert torch.equal(got, ref)
    assert torch.equal(torch.isinf(scores), torch.isinf(ref_scores))  # the same entries masked
    assert torch.allclose(scores, ref_scores, rtol=4 * 2 ** -24 * spec.heads, atol=0)
    exact, gaps = fp64_topk(*args, spec)
    assert not any(0 < gap < 1e-4 for gap in gaps)  # no near tie (exact ties break alike): the sets agree
    assert torch.equal(got, exact)
    assert got[0].tolist() == [-1] * 6 and got[1].tolist() == [0] + [-1] * 5  # positions 0 and 1 at ratio 2


def test_several_sweeps_of_the_selection_and_of_the_scoring():
    """N = 16 pages x 64 entries = 1024 scores: four sweeps of 256, eight scoring programs."""
    spec, args = _case("float32", K=40, per_page=64, R=3, max_pages=16, pool_pages=50, seed=3,
                       positions=(2047, 1500, 700))
    got, _ = mega_indexer(*args, spec, LaunchConfig(block_n=128, block_select=256))
    assert torch.equal(got, reference(*args, spec)[0])
    exact, gaps = fp64_topk(*args, spec)
    assert not any(0 < gap < 1e-6 for gap in gaps) and torch.equal(got, exact)


def test_exact_ties_go_to_the_lowest_entries():
    """A zeroed pool decodes to 0.0: every visible score is 0, so the first K visible entries win
    (what a synthetic context relies on); and duplicated key rows tie on their scores."""
    spec, (q, w, pool, pages, positions, _) = _case("float32", K=3)
    zeros = torch.zeros_like(pool)
    got, _ = mega_indexer(q, w, zeros, pages, positions, None, spec)
    assert got[4].tolist() == [0, 1, 2] and got[3].tolist() == [0, 1, 2]
    twin = pool.clone()
    twin[:] = pool[pages[4, 0], 0]  # every entry holds the same key: all scores tie
    assert mega_indexer(q, w, twin, pages, positions, None, spec)[0][4].tolist() == [0, 1, 2]


def test_an_allowed_mask_narrows_the_selectable_entries():
    """A reindex layer's candidate blocks: only allowed entries are chosen; rows with fewer than K
    allowed visible entries pad with -1."""
    spec, (q, w, pool, pages, positions, _) = _case("float32", K=6, seed=5)
    spec = dataclasses.replace(spec, allowed=True)
    allowed = torch.rand(5, 32, generator=torch.Generator().manual_seed(1)) < 0.4
    got, scores = mega_indexer(q, w, pool, pages, positions, allowed, spec)
    assert torch.equal(got, reference(q, w, pool, pages, positions, allowed, spec)[0])
    assert torch.equal(got, fp64_topk(q, w, pool, pages, positions, allowed, spec)[0])
    assert bool(torch.isinf(scores[~allowed]).all())
    with pytest.raises(ValueError, match="allowed must be bool"):
        mega_indexer(q, w, pool, pages, positions, None, spec)


def test_unsupported_specs_and_bad_inputs_are_refused_with_the_reason():
    spec, (q, w, pool, pages, positions, _) = _case("float32")
    assert "power of two" in unsupported_reason(IndexerSpec(4, 24, 6, 2, 8, "index_mxfp4", "float32"))
    assert "query dtype 'float16'" in unsupported_reason(IndexerSpec(4, 32, 6, 2, 8, "index_mxfp4", "float16"))
    assert "key format 'fp8'" in unsupported_reason(IndexerSpec(4, 32, 6, 2, 8, "fp8", "float32"))
    with pytest.raises(ValueError, match=r"w must be float32 \[5, 4\]"):
        mega_indexer(q, w.double(), pool, pages, positions, None, spec)
    with pytest.raises(ValueError, match=r"pool must be uint8 \[pages, 8, 17\]"):
        mega_indexer(q, w, pool[:, :4], pages, positions, None, spec)


# Scores whose order keys differ in one byte only (each radix pass decides among them), signed zeros
# (they tie), -inf (never chosen), negatives and repeats (ties to the lowest entry).
_ONE = 0x3F800000
_SCORE_BITS = [_ONE, _ONE + 1, _ONE + 0x100, _ONE + 0x101, _ONE + 0x10000, _ONE + 0x1000000, _ONE - 1,
               0x80000000 | _ONE, 0x80000000 | (_ONE + 1), 0x80000000 | (_ONE + 0x10000), 0x00000000, 0x80000000,
               0xFF800000, 0xFF7FFFFF, 0x7F7FFFFF, 0x00000001]


@st.composite
def _score_rows(draw):
    rows, n, k = draw(st.integers(1, 3)), draw(st.integers(1, 200)), draw(st.integers(1, 48))
    bits = draw(st.lists(st.sampled_from(_SCORE_BITS), min_size=rows * n, max_size=rows * n))
    scores = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).view(rows, n)
    return scores, k


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_score_rows(), st.sampled_from([(1, 16), (2, 64), (4, 32)]))
@example((torch.tensor([[-0.0, 1.0, 0.0, -0.0, 0.0]]), 2), (1, 16))  # the zeros tie: the lowest -0.0 wins
def test_the_selection_is_the_models_top_k_on_adversarial_scores(case, tiles):
    """The selection kernel alone against `select_topk` (a stable descending sort): keys a radix pass
    apart, ties, signed zeros, -inf, rows shorter than K; several rows a program and several sweeps."""
    scores, k = case
    block_rows, block_select = tiles
    spec = IndexerSpec(heads=1, head_dim=16, topk=k, ratio=1, per_page=1, key_format="float32", q_dtype="float32")
    got = select(scores, spec, LaunchConfig(block_n=16, block_select=block_select, block_rows=block_rows))
    assert torch.equal(got, select_topk(scores[None], k)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("q_dtype, fmt", [("bfloat16", "index_mxfp4"), ("float32", "index_mxfp4"),
                                          ("bfloat16", "bfloat16")])
def test_the_cuda_build_chooses_what_the_model_chooses_at_flash_lite_widths(q_dtype, fmt):
    """The GPU's own build (its tiles, vector loads of 68-byte MXFP4 rows, the histogram selection)
    at flash-lite's indexer widths: 32 heads x 128, top-512, 4096 entries a row over shuffled pages."""
    spec, args = _case(q_dtype, fmt, H=32, D=128, K=512, per_page=32, R=8, max_pages=128, pool_pages=1100, seed=2,
                       positions=(8191, 8190, 4000, 1023, 1, 0, 6000, 8191))
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    got, scores = mega_indexer(*args, spec)
    ref, ref_scores = reference(*args, spec)
    assert torch.equal(torch.isinf(scores), torch.isinf(ref_scores))
    finite = torch.isfinite(ref_scores)
    assert float((scores[finite] - ref_scores[finite]).abs().max()) <= 1e-5 * float(ref_scores[finite].abs().max())
    exact, gaps = fp64_topk(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args), spec)
    assert not any(0 < gap < 1e-6 for gap in gaps)  # no near tie: the sets are the fp64 ones
    assert torch.equal(got.cpu(), exact)
