"""The torch reference of the fused op: the model's own maths (model.mhc, model.layers)."""

from __future__ import annotations

from .spec import MhcSpec


def reference(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec):
    """The torch reference of the fused op: `model.mhc` + `model.layers.rms_normalize`."""
    from megafuse.model.layers import rms_normalize
    from megafuse.model.mhc import hc_post, hc_pre, mhc_coefficients

    x = hc_post(y, streams, post, comb) if spec.has_post else streams
    pre = post_next = comb_next = None
    if spec.has_coefficients:
        pre, post_next, comb_next = mhc_coefficients(x, fn, base, scale, spec.sinkhorn_iters,
                                                     spec.hc_eps, spec.stat_eps)
    collapsed = hc_pre(x, pre if spec.pre == "fresh" else carried_pre)
    normalised = rms_normalize(collapsed, spec.norm_eps)
    if spec.norm_rounding == "twice":
        normalised = normalised.to(x.dtype).float()
    u = (normalised * norm_weight).to(x.dtype)
    return (x if spec.has_post else None), u, pre, post_next, comb_next