"""Mega-Indexer's kernels against the model's step (decode, index_scores, select_topk) and an fp64
top-k written here: random keys in every cache format, exact ties, rows that see fewer than K
entries, pages in any order, negative scores."""

import pytest
import torch

from megafuse.lowering.mega_indexer import IndexerSpec, LaunchConfig, mega_indexer, reference, unsupported_reason
from megafuse.model import quant


def _case(fmt: str, *, H=4, D=32, K=6, ratio=2, per_page=8, R=5, max_pages=4, pool_pages=30, seed=0,
          positions=(0, 1, 5, 40, 63)):
    g = torch.Generator().manual_seed(seed)
    spec = IndexerSpec(heads=H, head_dim=D, topk=K, ratio=ratio, per_page=per_page, key_format=fmt,
                       q_dtype="float32", q_bf16_values=fmt != "float32")
    pool = spec.codec().encode(torch.randn(pool_pages, per_page, D, generator=g))
    pages = torch.randperm(pool_pages, generator=g)[: R * max_pages].view(R, max_pages)
    q = torch.randn(R, H, D, generator=g)
    q = quant.fake_quant_index_mxfp4(q) if fmt == "index_mxfp4" else q.to(torch.bfloat16).float() if fmt == "bfloat16" else q
    w = torch.randn(R, H, generator=g)  # negative weights: negative scores too
    return spec, (q, w, pool, pages, torch.tensor(positions[:R]))


def fp64_topk(q, w, pool, pages, positions, spec):
    """Written here, in fp64: the decoded keys, sum_h w relu(q . k), the visible entries' K largest
    (ties to the lowest entry), ascending, -1 padded; with the gap between the K-th and the next score
    (0 for an exact tie, which both break to the lowest entry; a tiny one would be a near tie)."""
    keys = spec.codec().decode(pool[pages].flatten(1, 2), torch.float64)  # [R, N, d]
    scores = (w.double()[:, :, None] * torch.einsum("rhd,rnd->rhn", q.double(), keys).clamp(min=0)).sum(1)
    out, gaps = [], []
    for r in range(q.shape[0]):
        n_visible = min((int(positions[r]) + 1) // spec.ratio, keys.shape[1])
        order = sorted(range(n_visible), key=lambda n: (-scores[r, n].item(), n))
        chosen = sorted(order[: spec.topk])
        out.append(chosen + [-1] * (spec.topk - len(chosen)))
        if n_visible > spec.topk:
            gaps.append(abs(scores[r, order[spec.topk - 1]] - scores[r, order[spec.topk]]).item())
    return torch.tensor(out), gaps


@pytest.mark.parametrize("fmt", ["index_mxfp4", "float32", "bfloat16"])
def test_the_kernels_choose_what_the_model_chooses_in_every_key_format(fmt):
    spec, args = _case(fmt)
    got = mega_indexer(*args, spec)
    assert got.dtype == torch.int64 and got.shape == (5, 6)
    assert torch.equal(got, reference(*args, spec))
    exact, gaps = fp64_topk(*args, spec)
    assert not any(0 < gap < 1e-4 for gap in gaps)  # no near tie (exact ties break alike): the sets agree
    assert torch.equal(got, exact)
    assert got[0].tolist() == [-1] * 6 and got[1].tolist() == [0] + [-1] * 5  # positions 0 and 1 at ratio 2


def test_several_sweeps_of_the_selection_and_of_the_scoring():
    """N = 16 pages x 64 entries = 1024 scores: four sweeps of 256, eight scoring programs."""
    spec, args = _case("index_mxfp4", K=40, per_page=64, R=3, max_pages=16, pool_pages=50, seed=3,
                       positions=(2047, 1500, 700))
    got = mega_indexer(*args, spec, LaunchConfig(block_n=128, block_select=256))
    assert torch.equal(got, reference(*args, spec))
    exact, gaps = fp64_topk(*args, spec)
    assert not any(0 < gap < 1e-6 for gap in gaps) and torch.equal(got, exact)


def test_exact_ties_go_to_the_lowest_entries():
    """A zeroed pool decodes to 0.0: every visible score is 0, so the first K visible entries win
    (what a synthetic context relies on); and duplicated key rows tie on their scores."""
    spec, (q, w, pool, pages, positions) = _case("index_mxfp4", K=3)
    zeros = torch.zeros_like(pool)
    got = mega_indexer(q, w, zeros, pages, positions, spec)
    assert got[4].tolist() == [0, 1, 2] and got[3].tolist() == [0, 1, 2]
    twin = pool.clone()
    twin[:] = pool[pages[4, 0], 0]  # every entry holds the same key: all scores tie
    assert mega_indexer(q, w, twin, pages, positions, spec)[4].tolist() == [0, 1, 2]


def test_unsupported_specs_and_bad_inputs_are_refused_with_the_reason():
    spec, (q, w, pool, pages, positions) = _case("index_mxfp4")
    assert "power of two" in unsupported_reason(IndexerSpec(4, 24, 6, 2, 8, "index_mxfp4", "float32"))
    assert "key format 'fp8'" in unsupported_reason(IndexerSpec(4, 32, 6, 2, 8, "fp8", "float32"))
    with pytest.raises(ValueError, match=r"w must be float32 \[5, 4\]"):
        mega_indexer(q, w.double(), pool, pages, positions, spec)
    with pytest.raises(ValueError, match=r"pool must be uint8 \[pages, 8, 17\]"):
        mega_indexer(q, w, pool[:, :4], pages, positions, spec)
