"""CSA2 pieces at their boundaries: SWA window, compressor visibility, top-k, candidates, sink."""

import math

import torch

from megafuse.model import build_model, preset
from megafuse.model.attention import (candidate_mask, select_topk, sparse_attention_with_sink, visible_entries)
from megafuse.model.rope import apply_rope, rope_angles, rope_frequencies


def test_compressed_entry_visibility_boundaries():
    pos = torch.arange(8)
    vis2 = visible_entries(pos, 4, ratio=2)
    # entry j (tokens 2j, 2j+1) becomes visible exactly at position 2j+1
    for p in range(8):
        assert vis2[p].tolist() == [j < (p + 1) // 2 for j in range(4)]
    assert not vis2[0].any() and vis2[1, 0] and not vis2[2, 1] and vis2[3, 1]
    assert torch.equal(visible_entries(pos, 8, ratio=1), torch.tril(torch.ones(8, 8, dtype=torch.bool)))


def test_swa_window_limits_at_boundaries():
    cfg = preset("tiny").replace(quant="none")
    model = build_model(cfg, seed=0)
    attn = model.layers[0].attn  # SWA-only
    W, T = cfg.window, 20
    rows = torch.randn(1, T, cfg.head_dim)
    keys, valid = attn._window(rows, T)
    for t in range(T):
        seen = [int(p) for p, v in zip(range(t - W + 1, t + 1), valid[t]) if v]
        assert seen == list(range(max(0, t - W + 1), t + 1))
        first = max(0, t - W + 1)
        assert torch.equal(keys[0, t, W - (t - first + 1):], rows[0, first:t + 1])


def test_swa_window_is_enforced_in_the_model():
    """A token exactly W positions back no longer reaches a SWA-only layer's output."""
    cfg = preset("tiny").replace(quant="none", n_layers=2, compress_ratios=(0, 1), kv_source_layers=(1,),
                                 index_source_layers=(1,), engram_layers=(), candidate_blocks=4, candidate_block_size=2)
    model = build_model(cfg, seed=0)
    attn = model.layers[0].attn
    T, W = 12, cfg.window
    u = torch.randn(1, T, cfg.dim)
    base = attn(u, torch.arange(T), {})
    for changed in (T - 1 - W, T - W):
        v = u.clone()
        v[0, changed] += 1.0
        diff = (attn(v, torch.arange(T), {})[0, -1] - base[0, -1]).abs().max()
        # position T-1 sees T-W .. T-1
        assert (diff > 1e-6) == (changed >= T - W), (changed, diff)


def test_select_topk_sorted_ascending_with_minus_one_padding_and_lowest_index_ties():
    s = torch.tensor([[[0.5, 2.0, float("-inf"), 2.0, 1.0]]])
    assert select_topk(s, 2).tolist() == [[[1, 3]]]
    assert select_topk(s, 3).tolist() == [[[1, 3, 4]]]
    assert select_topk(s, 6).tolist() == [[[0, 1, 3, 4, -1, -1]]]
    ties = torch.zeros(1, 1, 6)
    assert select_topk(ties, 3).tolist() == [[[0, 1, 2]]]  # ties go to the lowest index
    assert select_topk(torch.zeros(1, 1, 0), 2).tolist() == [[[-1, -1]]]


def test_candidate_mask_keeps_top_blocks_and_pins_the_newest():
    # 8 entries, blocks of 2, keep 2 blocks; the query at position 6 (ratio 1) sees entries 0..6.
    scores = torch.tensor([[[9.0, 0.0, 1.0, 1.0, 5.0, 0.0, -3.0, float("-inf")]]])
    mask = candidate_mask(scores, torch.tensor([6]), ratio=1, n_blocks_kept=2, block_size=2)
    # blocks: [0,1] max 9, [2,3] max 1, [4,5] max 5, [6,7] pinned (newest = 6) -> keep {pinned, block 0}
    assert mask[0, 0].tolist() == [True, True, False, False, False, False, True, True]
    # fewer blocks than kept: all blocks with a finite score or the pin are kept, -inf blocks dropped
    short = torch.tensor([[[1.0, 2.0, float("-inf"), float("-inf")]]])
    mask = candidate_mask(short, torch.tensor([1]), ratio=1, n_blocks_kept=4, block_size=2)
    assert mask[0, 0].tolist() == [True, True, False, False]


def _attention_reference(q, keys, valid, sink, scale):
    B, T, H, Dh = q.shape
    out = torch.zeros(B, T, H, Dh, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                s = [float(q[b, t, h].double() @ keys[b, t, j].double()) * scale
                     for j in range(keys.shape[2]) if valid[b, t, j]]
                rows = [keys[b, t, j].double() for j in range(keys.shape[2]) if valid[b, t, j]]
                m = max(s + [float(sink[h])])
                den = sum(math.exp(v - m) for v in s) + math.exp(float(sink[h]) - m)
                for v, r in zip(s, rows):
                    out[b, t, h] += math.exp(v - m) / den * r
    return out


def test_sparse_attention_with_sink_against_scalar_reference():
    g = torch.Generator().manual_seed(0)
    B, T, H, J, Dh = 2, 3, 4, 7, 16
    q, keys = torch.randn(B, T, H, Dh, generator=g), torch.randn(B, T, J, Dh, generator=g)
    valid = torch.rand(B, T, J, generator=g) > 0.4
    valid[0, 0] = False  # a query with no valid key attends to nothing: exactly 0
    sink = torch.randn(H, generator=g)
    out = sparse_attention_with_sink(q, keys, valid, sink, Dh ** -0.5)
    ref = _attention_reference(q, keys, valid, sink, Dh ** -0.5)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.equal(out[0, 0], torch.zeros(H, Dh))


def test_yarn_frequencies_follow_the_formula():
    cfg = preset("flash")
    f = rope_frequencies(cfg, 2).double()  # ratio 2: theta 160000 + YaRN
    rd, theta = 64, 160000.0
    base = [theta ** (-2 * i / rd) for i in range(rd // 2)]
    corr = lambda r: rd * math.log(65536 / (2 * math.pi * r)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), rd - 1)
    for i in range(rd // 2):
        ramp = min(max((i - low) / max(high - low, 1e-3), 0), 1)
        assert math.isclose(f[i], base[i] / 16 * ramp + base[i] * (1 - ramp), rel_tol=1e-6)
    plain = rope_frequencies(cfg, 0).double()
    assert torch.allclose(plain, torch.tensor([10000.0 ** (-2 * i / rd) for i in range(rd // 2)], dtype=torch.float64), rtol=1e-6)


def test_rope_rotates_only_the_tail_in_interleaved_pairs_and_inverts():
    x = torch.randn(3, 2, 32)
    freqs = torch.tensor([1.0, 0.5, 0.25, 0.125])
    ang = rope_angles(torch.tensor([0, 1, 7]), freqs)[:, None, :]
    y = apply_rope(x, ang)
    assert torch.equal(y[..., :24], x[..., :24])
    p = 2  # position 7, pair 1 -> dims 26, 27
    a = 7 * 0.5
    assert torch.allclose(y[p, :, 26], x[p, :, 26] * math.cos(a) - x[p, :, 27] * math.sin(a), atol=1e-6)
    assert torch.allclose(y[p, :, 27], x[p, :, 26] * math.sin(a) + x[p, :, 27] * math.cos(a), atol=1e-6)
    assert torch.allclose(apply_rope(y, ang, inverse=True), x, atol=1e-6)


def test_ratio_2_compressor_projects_in_fp32_in_a_bf16_model():
    # docs/model.md section 4: k = wkv(u), g = wgate(u) in fp32 for ratio 2; ratio 1 stays in the model dtype
    from megafuse.model.attention import Compressor

    cfg = preset("tiny").replace(dtype="bfloat16")
    two, one = Compressor(cfg, 2, torch.bfloat16), Compressor(cfg, 1, torch.bfloat16)
    assert two.wkv.weight.dtype == two.wgate.weight.dtype == torch.float32
    assert one.wkv.weight.dtype == torch.bfloat16
    u = torch.randn(1, 5, cfg.dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    latents = two(u)
    # the reference: the same maths in fp64 from the same (fp32) weights, rounded where the model rounds
    x = u.double()
    k, g = x @ two.wkv.weight.double().t(), x @ two.wgate.weight.double().t()
    kg = torch.stack((k, g), dim=2)[:, :4].unflatten(1, (2, 2))
    latent = (torch.softmax(kg[..., 1, :], dim=2) * kg[..., 0, :]).sum(dim=2).to(torch.bfloat16)
    want = two.norm(latent)
    assert latents.dtype == torch.bfloat16 and latents.shape == (1, 2, cfg.head_dim)  # the 5th token waits
    assert (latents.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()
    # a bf16 projection (the weights rounded to bf16 first) is measurably another latent
    two.to(torch.bfloat16)
    rounded = two(u)
    assert (rounded.float() - latents.float()).abs().max().item() > 0
