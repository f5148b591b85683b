"""Small building blocks: RMSNorm (fp32 statistics and weights), seeded weights, FP8 GEMMs."""

import torch
import torch.nn.functional as F
from torch import nn

from .quant import fake_quant_mxfp8


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        # Norm weights stay fp32 in every dtype mode (they multiply fp32 statistics).
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * self.weight).to(x.dtype)


def weight(shape: tuple[int, ...], fan_in: int, dtype: torch.dtype) -> nn.Parameter:
    """A weight drawn U(-1/sqrt(fan_in), 1/sqrt(fan_in)) in place, directly in `dtype` (no fp32 copy
    of a 27 GB expert bank), from the default generator the model seeds before construction."""
    bound = fan_in ** -0.5
    return nn.Parameter(torch.empty(shape, dtype=dtype).uniform_(-bound, bound))


class Linear(nn.Linear):
    """A bias-free linear layer; an FP8 GEMM of the released model when `mxfp8_input`: under
    quant="ref" its input is rounded through MXFP8 (e4m3, ue8m0 per 32 along K) first, as the FP8
    GEMM reads it (docs/model.md Decision 5). The weight itself stays in the model dtype."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, mxfp8_input: bool = False):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.weight = weight((out_features, in_features), in_features, dtype)
        self.mxfp8_input = mxfp8_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quant_mxfp8(x) if self.mxfp8_input else x, self.weight)


def linear(in_features: int, out_features: int, dtype: torch.dtype, mxfp8_input: bool = False) -> Linear:
    return Linear(in_features, out_features, dtype, mxfp8_input)
