"""One mHC seam, written in any of many equivalent ways (and in a few that change its maths).

`Spelling` is a set of discrete choices: how each step of the seam (docs/model.md section 3) is spelled
in torch, the seam's form (which steps it has), the token count and the dtypes of the streams and
of the parameters. `SpelledSeam(spelling)` is the module that computes it; every spelling without a
`near_miss` computes the same function as `model.mhc` (up to fp rounding), so the Mega-mHC pass
must fuse each one whole. A `near_miss` names one change of the maths (NEAR_MISSES: the reason the
pass must give); the pass must leave the changed part unfused and say why.

The spelling tests (test_mega_mhc_spellings.py) draw spellings with hypothesis; the choices are
plain tuples here so that other tests can build one seam by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

N = 4  # residual streams
HC_EPS, STAT_EPS, NORM_EPS = 1e-6, 1e-6, 1e-5

FORMS = ("delayed", "first", "final", "fresh")  # post + head + carried pre; head only; post only; V4
LEADS = ("T", "1T", "2T")  # leading dims: [T], [1, T], [2, T]
STREAM_DTYPES = ("float32", "bfloat16", "float16")
PARAM_DTYPES = ("float32", "bfloat16")

CHOICES = {  # field -> the equivalent spellings of that step
    # the post: X' = (post[j] y + sum_i comb[i, j] X[i]).to(dtype)
    "mix": ("einsum", "transpose_matmul", "mT_matmul", "bmm", "broadcast_sum", "xt_c_transposed"),
    "gate": ("unsqueeze", "index", "y_first"),
    "post_add": ("gate_first", "mix_first"),
    "y_upcast": ("float", "promote"),
    # the coefficient statistic and projection
    "flatten": ("flatten", "reshape", "view", "float_first"),
    "stat": ("pow_mean", "square_mean", "mul_mean", "mul_sum_div"),
    "keepdim": ("keepdim", "unsqueeze"),
    "rsqrt": ("rsqrt", "recip_sqrt", "method", "one_over_sqrt"),
    "projection": ("matmul_t", "linear", "einsum", "mm"),
    "r_at": ("after", "before", "left"),
    # the three parts of the mix and of base, scale, the affine maps and the gates
    "parts": ("split", "slices", "narrow"),
    "base_parts": ("split", "slices"),
    "scale_read": ("index", "unbind"),
    "affine": ("m_s_b", "s_m_b", "b_m_s"),
    "pre_eps": ("after", "before"),
    "post_gate": ("2x", "x2"),
    "comb_shape": ("view", "unflatten", "reshape"),
    "comb_shape_at": ("after_affine", "before_affine"),
    "param_upcast": ("explicit", "promote"),
    # Sinkhorn
    "softmax": ("softmax", "method", "functional", "explicit_max", "exp_sum"),
    "sinkhorn": ("loop", "unrolled"),
    "sink_sum": ("keepdim", "unsqueeze", "positive_dim"),
    "sink_eps": ("after", "before"),
    # the collapse and the norm
    "collapse": ("index_none", "unsqueeze", "x_first"),
    "collapse_upcast": ("float", "promote"),
    "round_c": ("to", "type_as"),
    "norm": ("w_last", "w_first", "w_middle", "llama"),  # llama: w * (c * r).to(dtype), rounded again
    "norm_stat": ("pow_mean", "square_mean", "mul_mean", "mul_sum_div"),
    "norm_rsqrt": ("rsqrt", "recip_sqrt", "method", "one_over_sqrt"),
}
POST_FIELDS = ("mix", "gate", "post_add", "y_upcast")
HEAD_FIELDS = ("flatten", "stat", "keepdim", "rsqrt", "projection", "r_at", "parts", "base_parts", "scale_read",
               "affine", "pre_eps", "post_gate", "comb_shape", "comb_shape_at", "param_upcast", "softmax",
               "sinkhorn", "sink_sum", "sink_eps", "iters", "hc_dtype")

@dataclass(frozen=True)
class NearMiss:
    """A change of the seam's maths: what it changes, the part of the seam that must then stay
    unfused ("post", "head", or "collapse": the whole seam), the words of the pass's reason, and
    the forms (and fixed choices) it applies to."""

    change: str
    part: str
    reason: str
    forms: tuple[str, ...] = ("delayed", "first")
    fixed: dict = dataclasses.field(default_factory=dict)


NEAR_MISSES = {
    "mix_not_transposed": NearMiss("comb @ X: sums over comb's second index (C X, not C^T X)", "post",
                                   "not C^T X", ("delayed", "final", "fresh")),
    "mix_in_stream_dtype": NearMiss("post and comb rounded to the stream dtype and mixed there (HF's bf16 post)",
                                    "post", "the post mixes in", ("delayed", "final", "fresh"),
                                    {"stream_dtype": ("bfloat16", "float16")}),
    "sinkhorn_ends_on_rows": NearMiss("one more row normalisation after the last column one", "head",
                                      "Sinkhorn does not end on a column normalisation"),
    "sinkhorn_starts_on_rows": NearMiss("the first normalisation divides by row sums", "head",
                                        "Sinkhorn does not start on a column normalisation"),
    "pre_eps_differs": NearMiss("pre's eps is not Sinkhorn's", "head", "pre's eps differs from Sinkhorn's eps"),
    "sinkhorn_eps_differs": NearMiss("the second round's row normalisation adds another eps", "head",
                                     "adds eps 1e-05, not 1e-06", fixed={"iters": (3, 20)}),
    "post_gate_not_2_sigmoid": NearMiss("post = 3 sigmoid(.)", "head", "post gate is not 2 * sigmoid"),
    "pre_gate_not_sigmoid": NearMiss("pre = tanh(.) + eps", "head", "the pre gate is not sigmoid(.) + eps"),
    "softmax_over_rows": NearMiss("the comb softmax runs over dim -2", "head",
                                  "the comb softmax does not run over the last dim"),
    "scale_swapped": NearMiss("pre reads scale[1]", "head", "does not read scale[0]"),
    "stat_of_one_stream": NearMiss("the coefficient statistic is the mean square of stream 0, not of all n*D",
                                   "head", "the RMS statistic does not read the flattened stream"),
    "mix_used_outside": NearMiss("the coefficient mix m is also returned", "head",
                                 "is also used outside the mHC seam"),
    "norm_mean_over_tokens": NearMiss("the norm's mean runs over dim 0 (tokens), not over D", "collapse",
                                      "the RMS statistic's mean runs over dims [0], not the last dim", FORMS),
    "norm_stat_of_weighted": NearMiss("the norm's statistic is taken after the weight multiplies", "collapse",
                                      "the norm's statistic does not read the collapse", FORMS),
}


@dataclass(frozen=True)
class Spelling:
    form: str = "delayed"
    T: int = 8
    lead: str = "T"
    stream_dtype: str = "float32"
    hc_dtype: str = "float32"  # fn, base, scale
    norm_dtype: str = "float32"  # the norm weight
    iters: int = 20
    near_miss: str = ""
    mix: str = "einsum"
    gate: str = "unsqueeze"
    post_add: str = "gate_first"
    y_upcast: str = "float"
    flatten: str = "flatten"
    stat: str = "pow_mean"
    keepdim: str = "keepdim"
    rsqrt: str = "rsqrt"
    projection: str = "matmul_t"
    r_at: str = "after"
    parts: str = "split"
    base_parts: str = "split"
    scale_read: str = "index"
    affine: str = "m_s_b"
    pre_eps: str = "after"
    post_gate: str = "2x"
    comb_shape: str = "view"
    comb_shape_at: str = "after_affine"
    param_upcast: str = "explicit"
    softmax: str = "softmax"
    sinkhorn: str = "loop"
    sink_sum: str = "keepdim"
    sink_eps: str = "after"
    collapse: str = "index_none"
    collapse_upcast: str = "float"
    round_c: str = "to"
    norm: str = "w_last"
    norm_stat: str = "pow_mean"
    norm_rsqrt: str = "rsqrt"

    @property
    def has_post(self) -> bool:
        return self.form in ("delayed", "final", "fresh")

    @property
    def has_head(self) -> bool:
        return self.form != "final"

    def key(self) -> tuple:
        """The choices that shape this seam's graph (a post's spelling means nothing without a post):
        two spellings with one key are one spelling."""
        skip = (() if self.has_post else POST_FIELDS) + (() if self.has_head else HEAD_FIELDS)
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in skip)

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return {"T": (self.T,), "1T": (1, self.T), "2T": (2, self.T)}[self.lead]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _rms(x: torch.Tensor, stat: str, keepdim: str, rsqrt: str, eps: float, dim: int = -1) -> torch.Tensor:
    """1 / sqrt(mean(x^2, dim) + eps), keeping the reduced dim, spelled as chosen."""
    keep = keepdim == "keepdim"
    if stat == "pow_mean":
        v = x.pow(2).mean(dim, keepdim=keep)
    elif stat == "square_mean":
        v = x.square().mean(dim, keepdim=keep)
    elif stat == "mul_mean":
        v = (x * x).mean(dim, keepdim=keep)
    else:  # mul_sum_div
        v = (x * x).sum(dim, keepdim=keep) / x.shape[dim]
    if not keep:
        v = v.unsqueeze(dim)
    if rsqrt == "rsqrt":
        return torch.rsqrt(v + eps)
    if rsqrt == "method":
        return (v + eps).rsqrt()
    if rsqrt == "recip_sqrt":
        return torch.sqrt(v + eps).reciprocal()
    return 1 / torch.sqrt(v + eps)  # one_over_sqrt


def _parts(t: torch.Tensor, how: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[.., (2+n)n] -> [.., n], [.., n], [.., n*n]."""
    if how == "split":
        return t.split([n, n, n * n], dim=-1)
    if how == "narrow":
        return t.narrow(-1, 0, n), t.narrow(-1, n, n), t.narrow(-1, 2 * n, n * n)
    return t[..., :n], t[..., n:2 * n], t[..., 2 * n:]


class SpelledSeam(nn.Module):
    """The seam of `spelling`: forward(X, y, post, comb, carried) -> its outputs (X' where it has a
    post, u, and pre', post', comb' where it has a head)."""

    def __init__(self, spelling: Spelling, dim: int = 32, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        s, n, width = spelling, N, (2 + N) * N
        self.s, self.dim = spelling, dim
        hc, nw = _dtype(s.hc_dtype), _dtype(s.norm_dtype)
        self.fn = nn.Parameter((torch.randn(width, n * dim, generator=g) * (0.1 / (n * dim) ** 0.5)).to(hc))
        base = torch.randn(width, generator=g) * 0.5
        base[2 * n:] += (2 * torch.eye(n)).flatten()
        self.base = nn.Parameter(base.to(hc))
        self.scale = nn.Parameter((1 + 0.1 * torch.randn(3, generator=g)).to(hc))
        self.norm_weight = nn.Parameter((1 + 0.1 * torch.randn(dim, generator=g)).to(nw))

    def inputs(self, seed: int = 1) -> tuple[torch.Tensor, ...]:
        """(X, y, post, comb, carried) of the model's scales: comb a real Sinkhorn output."""
        from megafuse.model.mhc import sinkhorn

        g = torch.Generator().manual_seed(seed)
        lead, n, dt = self.s.lead_shape, N, _dtype(self.s.stream_dtype)
        X = torch.randn(*lead, n, self.dim, generator=g).to(dt)
        y = torch.randn(*lead, self.dim, generator=g).to(dt)
        post = 2 * torch.sigmoid(torch.randn(*lead, n, generator=g))
        comb = sinkhorn(torch.randn(*lead, n, n, generator=g) + 2 * torch.eye(n), 20, HC_EPS)
        carried = torch.sigmoid(torch.randn(*lead, n, generator=g)) + HC_EPS
        return X, y, post, comb, carried

    # ---- the steps --------------------------------------------------------------------------

    def hc_post(self, X, y, post, comb):
        s, miss = self.s, self.s.near_miss
        Xf = X.float()
        if miss == "mix_in_stream_dtype":  # HF's bf16 post: rounded coefficients, mixed in the stream dtype
            return post.to(X.dtype).unsqueeze(-1) * y.unsqueeze(-2) + comb.to(X.dtype).transpose(-1, -2) @ X
        if miss == "mix_not_transposed":
            mixed = comb @ Xf
        elif s.mix == "einsum":
            mixed = torch.einsum("...ij,...id->...jd", comb, Xf)
        elif s.mix == "transpose_matmul":
            mixed = comb.transpose(-1, -2) @ Xf
        elif s.mix == "mT_matmul":
            mixed = torch.matmul(comb.mT, Xf)
        elif s.mix == "bmm":
            n, D = Xf.shape[-2:]
            mixed = torch.bmm(comb.reshape(-1, n, n).transpose(1, 2), Xf.reshape(-1, n, D)).view(Xf.shape)
        elif s.mix == "broadcast_sum":
            mixed = (comb.unsqueeze(-1) * Xf.unsqueeze(-2)).sum(-3)
        else:  # xt_c_transposed: (X^T C)^T = C^T X
            mixed = (Xf.transpose(-1, -2) @ comb).transpose(-1, -2)
        yf = y.float() if s.y_upcast == "float" else y
        if s.gate == "unsqueeze":
            gate = post.unsqueeze(-1) * yf.unsqueeze(-2)
        elif s.gate == "index":
            gate = post[..., None] * yf[..., None, :]
        else:
            gate = yf.unsqueeze(-2) * post.unsqueeze(-1)
        out = gate + mixed if s.post_add == "gate_first" else mixed + gate
        return out.to(X.dtype)

    def coefficients(self, X):
        s, miss, n = self.s, self.s.near_miss, N
        lead = X.shape[:-2]
        if s.flatten == "flatten":
            x = X.flatten(-2).float()
        elif s.flatten == "reshape":
            x = X.reshape(*lead, -1).float()
        elif s.flatten == "view":  # (a view needs a contiguous X', which (X^T C)^T does not leave)
            x = X.contiguous().view(*lead, n * self.dim).float()
        else:  # float_first
            x = X.float().flatten(-2)
        if miss == "stat_of_one_stream":
            r = torch.rsqrt(X[..., 0, :].float().pow(2).mean(-1, keepdim=True) + STAT_EPS)
        else:
            r = _rms(x, s.stat, s.keepdim, s.rsqrt, STAT_EPS)
        fn = self.fn.float()

        def project(v):
            if s.projection == "matmul_t":
                return v @ fn.t()
            if s.projection == "linear":
                return F.linear(v, fn)
            if s.projection == "einsum":
                return torch.einsum("...k,jk->...j", v, fn)
            return torch.mm(v.reshape(-1, v.shape[-1]), fn.t()).view(*v.shape[:-1], fn.shape[0])

        if s.r_at == "after":
            m = project(x) * r
        elif s.r_at == "left":
            m = r * project(x)
        else:  # before, HF's order: the projection reads x * r
            m = project(x * r)
        m_pre, m_post, m_comb = _parts(m, s.parts, n)
        upcast = s.param_upcast == "explicit"
        base = self.base.float() if upcast else self.base
        scale = self.scale.float() if upcast else self.scale
        b_pre, b_post, b_comb = _parts(base, s.base_parts, n)
        scales = scale.unbind(0) if s.scale_read == "unbind" else (scale[0], scale[1], scale[2])
        if miss == "scale_swapped":
            scales = (scales[1], scales[1], scales[2])

        def affine(mix, k, b):
            if s.affine == "m_s_b":
                return mix * scales[k] + b
            if s.affine == "s_m_b":
                return scales[k] * mix + b
            return b + mix * scales[k]

        def square(t):  # [.., n*n] -> [.., n, n]
            if s.comb_shape == "view":
                return t.view(*t.shape[:-1], n, n)
            if s.comb_shape == "unflatten":
                return t.unflatten(-1, (n, n))
            return t.reshape(*t.shape[:-1], n, n)

        pre_eps = 1e-5 if miss == "pre_eps_differs" else HC_EPS
        gate = torch.tanh if miss == "pre_gate_not_sigmoid" else torch.sigmoid
        pre = gate(affine(m_pre, 0, b_pre))
        pre = pre + pre_eps if s.pre_eps == "after" else pre_eps + pre
        post_gate = torch.sigmoid(affine(m_post, 1, b_post))
        factor = 3 if miss == "post_gate_not_2_sigmoid" else 2
        post = factor * post_gate if s.post_gate == "2x" else post_gate * factor
        if s.comb_shape_at == "after_affine":
            logits = square(affine(m_comb, 2, b_comb))
        else:  # HF: both [n, n] before the affine map
            logits = affine(square(m_comb), 2, b_comb.view(n, n))
        return pre, post, self.sinkhorn(logits), m

    def sinkhorn(self, logits):
        s, miss = self.s, self.s.near_miss
        dim = -2 if miss == "softmax_over_rows" else -1
        if s.softmax == "softmax":
            c = torch.softmax(logits, dim=dim)
        elif s.softmax == "method":
            c = logits.softmax(dim)
        elif s.softmax == "functional":
            c = F.softmax(logits, dim=dim)
        elif s.softmax == "explicit_max":
            e = torch.exp(logits - logits.amax(dim, keepdim=True))
            c = e / e.sum(dim, keepdim=True)
        else:  # exp_sum: the same maths without the max shift
            e = logits.exp()
            c = e / e.sum(dim, keepdim=True)
        rank = c.dim()

        def normalise(t, axis, eps=HC_EPS):  # axis: "col" (sum over i, dim -2) or "row" (dim -1)
            d = -2 if axis == "col" else -1
            if s.sink_sum == "keepdim":
                total = t.sum(d, keepdim=True)
            elif s.sink_sum == "unsqueeze":
                total = t.sum(d).unsqueeze(d)
            else:
                total = t.sum(rank + d, keepdim=True)
            return t / (total + eps if s.sink_eps == "after" else eps + total)

        c = c + HC_EPS if s.sink_eps == "after" else HC_EPS + c
        c = normalise(c, "row" if miss == "sinkhorn_starts_on_rows" else "col")
        odd_eps = 1e-5 if miss == "sinkhorn_eps_differs" else HC_EPS
        if s.sinkhorn == "loop":
            for k in range(s.iters - 1):
                c = normalise(c, "row", odd_eps if k == 1 else HC_EPS)
                c = normalise(c, "col")
        else:  # unrolled by hand: the same graph, another program
            rounds = [("row", "col")] * (s.iters - 1)
            k = 0
            while k < len(rounds):
                c = normalise(normalise(c, rounds[k][0], odd_eps if k == 1 else HC_EPS), rounds[k][1])
                k += 1
        if miss == "sinkhorn_ends_on_rows":
            c = normalise(c, "row")
        return c

    def collapse_norm(self, X, pre):
        s, miss = self.s, self.s.near_miss
        Xf = X.float() if s.collapse_upcast == "float" else X
        if s.collapse == "index_none":
            c = (pre[..., None] * Xf).sum(-2)
        elif s.collapse == "unsqueeze":
            c = (pre.unsqueeze(-1) * Xf).sum(dim=-2)
        else:
            c = (Xf * pre.unsqueeze(-1)).sum(-2)
        c = c.to(X.dtype) if s.round_c == "to" else c.type_as(X)
        xf = c.float()
        w = self.norm_weight.float() if s.param_upcast == "explicit" else self.norm_weight
        if miss == "norm_stat_of_weighted":
            xf = xf * w
            w = torch.ones_like(w)
        if miss == "norm_mean_over_tokens":
            r = torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + NORM_EPS)
        else:
            r = _rms(xf, s.norm_stat, "keepdim", s.norm_rsqrt, NORM_EPS)
        if s.norm == "w_last":
            u = xf * r * w
        elif s.norm == "w_first":  # HF's order
            u = w * (xf * r)
        elif s.norm == "llama":  # Llama-style RMSNorm: rounded, then weighted (and rounded again)
            u = w * (xf * r).to(X.dtype)
        else:
            u = (xf * w) * r
        return u.to(X.dtype)

    def forward(self, X, y, post, comb, carried):
        s = self.s
        if s.has_post:
            X = self.hc_post(X, y, post, comb)
        if not s.has_head:
            return X, self.collapse_norm(X, carried)
        pre, post_next, comb_next, m = self.coefficients(X)
        u = self.collapse_norm(X, pre if s.form == "fresh" else carried)
        out = ((X,) if s.has_post else ()) + (u, pre, post_next, comb_next)
        return out + ((m,) if s.near_miss == "mix_used_outside" else ())
