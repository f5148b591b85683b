"""The references the bf16 accuracy tests use (tests/model/precision.py), and their structure on a
CPU-sized case: the fused bf16 model and the eager bf16 model, each against the fp64 model of the
same weights, within the bound bf16's rounding gives."""

import pytest
import torch

from megafuse.model import build_model, preset
from tests.model.precision import (U_BF16, U_FP32, bf16_format_bound, fp64_copy, rel, stream_roundings,
                                   widened)
from tests.passes.post_grad import fuse
from tests.passes.tiny import every_role_tiny


def _ids(cfg, batch, length, seed=0):
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_widened_bf16_model_equals_its_fp64_copy():
    # The proxy's GPU tests evaluate the bf16 model in fp64 under `widened()` (no room for a copy);
    # here it meets the fp64 copy of the same weights. Both round at fp32 or finer (the copy runs
    # the experts in fp32, `widened` in fp64), so they differ by fp32 roundings along the same path:
    # at most stream_roundings x 2^-24 (the format bound's count, in fp32). quant="none": under
    # "ref" a fp32 difference may cross a FP8 / FP4 rounding boundary, which no fp32 bound covers.
    cfg = preset("tiny").replace(quant="none")
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    ids = _ids(cfg, 2, 8)
    with torch.no_grad():
        copied = fp64_copy(model)(ids)
        eager = model(ids)
    with widened():
        wide = model(ids)
    assert rel(wide, copied) <= stream_roundings(cfg) * U_FP32
    # and the bf16 model is not the reference: its own error is bf16-sized
    assert rel(eager, copied) > U_BF16 / 4


@pytest.mark.slow  # a whole model through the passes, its kernels in the Triton interpreter
def test_fused_bf16_tiny_is_within_the_format_bound_of_the_fp64_model():
    # The CPU case of tests/passes/test_gpu.py's bf16 check: every chain fused, the kernels run on
    # the post-grad graph (tests/passes/post_grad.py), compared with the fp64 model of the same
    # weights, as eager is, within what bf16's roundings allow (precision.bf16_format_bound).
    cfg = every_role_tiny(quant="none")
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    ids = _ids(cfg, 1, 8)
    with torch.no_grad():
        fused = fuse(model, "all", fullgraph=True)
        logits, eager = fused(ids), model(ids)
        exact = fp64_copy(model)(ids)
    assert fused.report.counts() == {"mega_mhc": 2 * cfg.n_layers + 1, "mega_gate": cfg.n_layers,
                                      "mega_attention": cfg.n_layers, "mega_moe": cfg.n_layers,
                                      "mega_indexer": 0}  # the prefill's indexer reads no cache bytes
    bound = bf16_format_bound(cfg)  # 23 roundings: 2^-8 x 23 = 9.0%
    assert rel(eager, exact) <= bound  # the bound's premise, on the model that defines the maths
    assert rel(logits, exact) <= bound, (rel(logits, exact), rel(eager, exact))
