"""GPU checks of the model (skipped without CUDA; run on the H200 with `pytest tests/model/test_gpu.py`).

The proxy preset has the full V4.1-Flash widths, so these are the real kernel shapes: bf16
activations stay finite and non-degenerate through every layer, and incremental decode through the
batched step and the byte cache, and the whole model compiled with fullgraph, are as accurate as
the eager bf16 forward: each is compared with the same weights evaluated in fp64
(tests/model/precision.py), not with the other bf16 evaluation.
"""

import pytest
import torch

from megafuse.model import CacheLayout, SequenceGroup, build_model, preset
from tests.model.precision import rel, widened

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _ids(cfg, batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=g).cuda()


def _decode_through_the_cache(model, ids, prompt_len):
    """Prefill ids[:, :prompt_len] in one step, then one decode step per later token: logits [B, L, V]."""
    B, L = ids.shape
    layout = CacheLayout.private(B, L)
    group = SequenceGroup(model.cfg, layout, ids.tolist(), "cuda")
    _, first = group.step(model.step, [(i, prompt_len, True) for i in range(B)])
    outs = [torch.stack(first)]
    for _ in range(prompt_len, L):
        _, rows = group.step(model.step, [(i, 1, True) for i in range(B)])
        outs.append(torch.stack(rows))
    return torch.cat(outs, dim=1)


def test_tiny_fp32_decode_and_compile_on_cuda():
    cfg = preset("tiny").replace(quant="none")
    model = build_model(cfg, seed=0, device="cuda")
    ids = _ids(cfg, 2, 40)
    with torch.no_grad():
        full = model(ids)
        stepped = _decode_through_the_cache(model, ids, 4)
        compiled = torch.compile(model, fullgraph=True)(ids)
    assert (stepped - full).abs().max().item() <= 1e-4
    assert (compiled - full).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def proxy():
    model = build_model(preset("proxy"), seed=0, device="cuda")
    yield model
    del model
    torch.cuda.empty_cache()


def test_proxy_bf16_activations_finite_and_non_degenerate_per_layer(proxy):
    cfg = proxy.cfg
    stats = []
    hooks = [b.register_forward_hook(lambda m, a, out: stats.append((m.layer, out[0].float().std().item(),
                                                                      bool(torch.isfinite(out[0]).all()))))
             for b in proxy.layers]
    with torch.no_grad():
        logits = proxy(_ids(cfg, 1, 256))
    for h in hooks:
        h.remove()
    print("proxy per-layer stream std:", [(layer, round(std, 3)) for layer, std, _ in stats])
    assert len(stats) == cfg.n_layers
    for layer, std, finite in stats:
        assert finite and 0.05 < std < 50, (layer, std)
    assert torch.isfinite(logits).all() and logits.std() > 0.1


# The proxy is bf16 with FP8 / FP4 / MXFP8 fake quantisation, so two bf16 evaluations of it differ
# by far more than bf16's 2^-8: a last-bit difference before a quantisation moves a value by a whole
# grid step when it sits near a rounding boundary (1/8 of it for e4m3). Each evaluation is therefore
# held to the eager bf16 forward's own error against the same weights evaluated in fp64, the
# config's reference precision (`widened`: the proxy leaves no room for a wider copy). The bound is
# K_SAME_MATHS times that error. Decode and the compiled model are bf16 evaluations of the same maths
# as the eager forward: the same weights, the same bf16 storage and quantisation points (the byte
# cache's codecs round exactly as the forward's fake quantisation), other summation orders inside
# fp32 accumulators. Their errors are draws of the same kind and size as eager's, and at the proxy's
# widths a logit's error sums thousands of independent rounding flips (MXFP8 blocks of 32 along
# 5120-wide rows, six experts of 384 per token), so the draws' norms agree closely. 2 leaves room for
# a draw twice as unlucky; a kernel that computes something else (a mask, an index, a scale off)
# lands far outside.
K_SAME_MATHS = 2.0


def test_proxy_decode_is_as_accurate_as_prefill(proxy):
    cfg = proxy.cfg
    ids = _ids(cfg, 1, 160, seed=1)  # past the 128-row window
    with torch.no_grad():
        full = proxy(ids)
        stepped = _decode_through_the_cache(proxy, ids, 140)
    with widened():
        exact = proxy(ids)
    decoded = slice(140, None)
    prefill_error = rel(full[:, decoded], exact[:, decoded])
    decode_error = rel(stepped[:, decoded], exact[:, decoded])
    print(f"proxy vs fp64, positions 140..159: prefill {prefill_error:.2e}, decode {decode_error:.2e}")
    assert decode_error <= K_SAME_MATHS * prefill_error


def test_proxy_compiled_fullgraph_is_as_accurate_as_eager(proxy):
    cfg = proxy.cfg
    ids = _ids(cfg, 1, 64, seed=2)
    with torch.no_grad():
        eager = proxy(ids)
        compiled = torch.compile(proxy, fullgraph=True)(ids)
    with widened():
        exact = proxy(ids)
    eager_error, compiled_error = rel(eager, exact), rel(compiled, exact)
    print(f"proxy vs fp64: eager {eager_error:.2e}, compiled {compiled_error:.2e}")
    assert compiled_error <= K_SAME_MATHS * eager_error
