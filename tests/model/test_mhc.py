"""mHC: Sinkhorn truncation, doubly stochastic comb, the transpose in hc_post, the delayed pre."""

import itertools

import torch

from megafuse.model.mhc import HyperConnection, hc_post, hc_pre, mhc_coefficients, sinkhorn


def _sinkhorn_loops(logits, iters, eps):
    """Independent scalar re-derivation of the Sinkhorn truncation of docs/model.md section 3 for one 4x4 matrix."""
    n = len(logits)
    c = [[0.0] * n for _ in range(n)]
    for i in range(n):
        row = [float(v) for v in logits[i]]
        m = max(row)
        e = [pow(2.718281828459045, v - m) for v in row]
        s = sum(e)
        c[i] = [v / s + eps for v in e]

    def cols():
        for j in range(n):
            s = sum(c[i][j] for i in range(n)) + eps
            for i in range(n):
                c[i][j] /= s

    def rows():
        for i in range(n):
            s = sum(c[i]) + eps
            c[i] = [v / s for v in c[i]]

    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return torch.tensor(c, dtype=torch.float64)


def test_sinkhorn_matches_scalar_reference_exactly_truncated():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 4, generator=g, dtype=torch.float64) * 3
    ours = sinkhorn(logits, 20, 1e-6)
    for b in range(5):
        assert torch.allclose(ours[b], _sinkhorn_loops(logits[b].tolist(), 20, 1e-6), atol=1e-12)
    # the truncation matters: 3 rounds differ measurably from 20
    assert (sinkhorn(logits, 3, 1e-6) - ours).abs().max() > 1e-4


def test_comb_is_doubly_stochastic():
    """At the model's parameter scale (its own init, comb logits spread by a random base)."""
    torch.manual_seed(1)
    n, D = 4, 64
    site = HyperConnection(n, D, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20)
    site.base.data += torch.randn(24)
    _, _, comb = site(torch.randn(256, n, D))
    assert (comb.sum(-1) - 1).abs().max() < 1e-3
    assert (comb.sum(-2) - 1).abs().max() < 1e-3
    assert (comb >= 0).all()
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-2  # non-trivial, non-symmetric


def test_coefficients_against_explicit_formulas():
    g = torch.Generator().manual_seed(2)
    n, D = 4, 32
    X = torch.randn(3, n, D, generator=g)
    fn, base, scale = torch.randn(24, n * D, generator=g), torch.randn(24, generator=g), torch.rand(3, generator=g) + 0.5
    pre, post, comb = mhc_coefficients(X, fn, base, scale, 20, 1e-6, 1e-20)
    for t in range(3):
        x = X[t].flatten().double()
        m = (fn.double() @ x) / x.square().mean().sqrt()
        assert torch.allclose(pre[t].double(), torch.sigmoid(m[:4] * scale[0] + base[:4]) + 1e-6, atol=1e-5)
        assert torch.allclose(post[t].double(), 2 * torch.sigmoid(m[4:8] * scale[1] + base[4:8]), atol=1e-5)
        ref = _sinkhorn_loops((m[8:] * scale[2] + base[8:]).view(4, 4).tolist(), 20, 1e-6)
        assert torch.allclose(comb[t].double(), ref, atol=1e-5)


def test_hc_post_uses_the_transpose_of_comb():
    """X'[j] = post[j] y + sum_i C[i, j] X[i]; a non-symmetric comb tells C from C^T."""
    n, D = 4, 5
    X = torch.arange(n * D, dtype=torch.float32).view(1, n, D)
    y = torch.ones(1, D)
    comb = torch.zeros(1, n, n)
    comb[0, 0, 1] = 1.0  # moves stream 0 into stream 1 only
    post = torch.tensor([[0.0, 0.0, 0.0, 2.0]])
    out = hc_post(y, X, post, comb)
    expected = torch.zeros(1, n, D)
    expected[0, 1] = X[0, 0]
    expected[0, 3] = 2.0
    assert torch.equal(out, expected)
    for i, j in itertools.product(range(n), range(n)):
        C = torch.rand(1, n, n)
        got = hc_post(torch.zeros(1, D), X, torch.zeros(1, n), C)
        assert torch.allclose(got[0, j], sum(C[0, k, j] * X[0, k] for k in range(n)), atol=1e-5)


def test_hc_pre_is_a_weighted_sum_in_stream_dtype():
    X = torch.randn(2, 4, 8).bfloat16()
    pre = torch.tensor([[1.0, 0, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    out = hc_pre(X, pre)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], X[0, 0])
    assert torch.allclose(out[1].float(), X[1].float().mean(0), atol=1e-2)
