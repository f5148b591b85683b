"""Interleaved partial RoPE with YaRN frequencies (docs/model.md section 4).

RoPE rotates the *last* `rope_dim` dims of a vector, in interleaved pairs (x[2i], x[2i+1]).
Layers with compress ratio 0 use theta 10000 and plain frequencies; every rotation in a layer with
ratio > 0 (main Q, SWA KV, compressed latent, indexer Q and K, the inverse rotation) uses theta
160000 with YaRN (factor 16, original length 65536, beta_fast 32, beta_slow 1, no mscale).
"""

import math

import torch

from .config import ModelConfig


def rope_frequencies(cfg: ModelConfig, layer: int) -> torch.Tensor:
    """The `rope_dim // 2` per-pair frequencies f_i (fp32) of one layer."""
    rd = cfg.rope_dim
    yarn = cfg.is_rope_yarn(layer)
    theta = cfg.compress_rope_theta if yarn else cfg.rope_theta
    freqs = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if yarn:
        def correction(rotations: float) -> float:
            return rd * math.log(cfg.yarn_original_max_pos / (2 * math.pi * rotations)) / (2 * math.log(theta))

        low = max(math.floor(correction(cfg.yarn_beta_fast)), 0)
        high = min(math.ceil(correction(cfg.yarn_beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / cfg.yarn_factor * ramp + freqs * (1 - ramp)
    return freqs.float()


def rope_angles(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Angles [..., rope_dim // 2] = position * f_i, in fp32."""
    return positions.float()[..., None] * freqs


def apply_rope(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * angles.shape[-1] dims of x by `angles` (by -angles when `inverse`).

    `angles` broadcasts against x's leading dims with a trailing pair axis: for x [B, T, H, Dh]
    pass angles [B or 1, T, 1, rd // 2]. The rotation runs in fp32; the result has x's dtype.
    """
    rd = 2 * angles.shape[-1]
    head, tail = x[..., :-rd], x[..., -rd:].float()
    pairs = tail.unflatten(-1, (rd // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((head, rotated.to(x.dtype)), dim=-1)
