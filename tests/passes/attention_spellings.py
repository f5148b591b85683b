"""A sink attention written the way a user outside the project writes it, in any of many equivalent
ways (and a few that change its maths). Nothing here calls megafuse.model.

Per head h a learned sink; per query the scores s_j = (q . k_j) * scale over its keys, -inf where a
key is invalid, and

    o = sum_j e^(s_j - m) k_j / (sum_j e^(s_j - m) + e^(sink_h - m))      (the values are the keys)

with m = max(max_j s_j, sink_h) (the sink folded into the max) or m = max_j s_j (the sink only in
the denominator): m cancels, so both are one function. Then the inverse RoPE on the last ROPE_DIM
dims (pairs (2i, 2i + 1) rotated by -angle_i) and the cast to the input dtype: MegaAttention
matches the attention with its inverse RoPE, not without (docs/mega_attention.md).

Two layouts:
- "gathered": each query row [B, T] with its own key rows (the model's sparse form):
  q [B, T, H, D], keys [B, T, J, D], valid [B, T, J], angles [B, T, rd / 2]; the RoPE by pairs;
- "dense": one key head for all the queries of a sequence, scores [B, H, T, S]:
  q [B, H, T, D], keys [B, S, D], valid [B, T, S] (or [T, S]), angles [1, T, rd / 2]; the RoPE the
  rotate-half way (HF's), its output [B, H, T, D].
Either with B = 2 sequences of several queries, or one query (B = T = 1, a decode step).

`Spelling` is a set of discrete choices (CHOICES); `SpelledAttention(spelling)` computes it;
`reference` computes the function in fp64 from the same inputs, whatever the spelling;
`check_fused` and `check_near_miss` are what the tests assert of a spelling.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor import config as inductor_config

from tests.passes.cuda_forms import TORCH_2_11_FORMS
from tests.passes.post_grad import fuse

HEADS, HEAD_DIM, ROPE_DIM = 4, 32, 8
B, T, J = 2, 3, 12  # gathered: rows [B, T], each with its J keys
DENSE_T, S = 5, 9  # dense: the T queries of a sequence over its S keys
NEG_INF = float("-inf")

CHOICES = {  # field -> its equivalent spellings
    "layout": ("gathered", "dense"),
    "rows": ("many", "one"),  # B = 2 sequences of T queries | one query (a decode step): GEMMs of batch one
    "max": ("with_sink", "plain"),  # m = max(max_j s_j, sink) | m = max_j s_j
    "rowmax": ("amax", "max_values", "max_unsqueeze"),  # amax(keepdim) | max(dim, keepdim).values | [..., None]
    "maximum": ("maximum", "max", "clamp"),  # torch.maximum(a, sink) | torch.max(a, sink) | a.clamp(min=sink)
    "softmax": ("spelled", "column", "column_spelled"),  # exp / (sum + e^(sink - m)) | softmax(cat([s, sink]))
    "denominator": ("sum_first", "sink_first"),
    "sink": ("view", "reshape", "index", "unsqueeze"),  # [1, 1, H, 1] | [H, 1] | [None, .., :, None] | [H, 1]
    "sink_dtype": ("float32", "bfloat16"),
    "mask": ("masked_fill", "where_valid", "logical_not", "additive", "finfo_min", "drop_mask"),
    "mask_rows": ("per_sequence", "shared"),  # dense: valid [B, T, S], or [T, S] for every sequence
    "scores": ("einsum", "matmul", "expand"),  # dense "expand": the key head expanded over the heads first
    "scale": ("mul", "div"),
    "rotation": ("minus_sin", "plus_sin"),  # gathered: (x cos - y (-sin), x (-sin) + y cos) | (x cos + y sin, y cos - x sin)
    "dtype": ("float32", "bfloat16"),
    "upcast": ("inputs", "scores"),  # 16-bit q and keys to fp32 first | the 16-bit GEMM's scores to fp32
    "graph": ("cpu", "cuda"),  # cuda: the GPU's graph forms (tests/passes/cuda_forms.py)
}


@dataclass(frozen=True)
class Spelling:
    layout: str = "gathered"
    rows: str = "many"
    max: str = "with_sink"
    rowmax: str = "amax"
    maximum: str = "maximum"
    softmax: str = "spelled"
    denominator: str = "sum_first"
    sink: str = "view"
    sink_dtype: str = "float32"
    mask: str = "masked_fill"
    mask_rows: str = "per_sequence"
    scores: str = "einsum"
    scale: str = "mul"
    rotation: str = "minus_sin"
    dtype: str = "float32"
    upcast: str = "inputs"
    graph: str = "cpu"
    near_miss: str = ""

    def valid(self) -> "Spelling":
        """This spelling with the choices that mean nothing in it set to one value, so that one
        attention has one Spelling (the strategies draw every field freely)."""
        s = self
        if s.softmax != "spelled":  # the softmax over [s, sink] takes its max over both
            s = dataclasses.replace(s, max="with_sink", maximum="maximum", denominator="sum_first")
        if s.max == "plain":
            s = dataclasses.replace(s, maximum="maximum")
        if s.softmax == "column":
            s = dataclasses.replace(s, rowmax="amax")
        if s.layout == "gathered":
            s = dataclasses.replace(s, scores="matmul" if s.scores == "expand" else s.scores,
                                    mask_rows="per_sequence")
        else:  # the dense layout rotates the rotate-half way
            s = dataclasses.replace(s, rotation="minus_sin")
        if s.dtype == "float32":
            s = dataclasses.replace(s, upcast="inputs")
        return s

    def seed(self) -> int:
        """Inputs per spelling, the same in every process (hash() of text is salted per process)."""
        return zlib.crc32(repr(self).encode())

    @property
    def rounds_scores(self) -> bool:
        """Whether the eager chain rounds its scores to 16 bits (the dense layout also P and the
        rotation): the kernel does not."""
        return self.upcast == "scores" and self.dtype != "float32"


@dataclass(frozen=True)
class NearMiss:
    """A change the pass does not fuse: what it is, the words of the pass's reason, the choices it
    needs; another function, or (`equivalent`) the same one in a spelling the pass does not read."""
    change: str
    reason: str
    fixed: dict = dataclasses.field(default_factory=dict)
    equivalent: bool = False


NEAR_MISSES = {
    "no_sink": NearMiss("a plain softmax: no sink anywhere", "the softmax's denominator has no sink term"),
    "sink_only_in_max": NearMiss("the sink in the max, not in the denominator",
                                 "the softmax's denominator has no sink term", {"softmax": ("spelled",)}),
    "softmax_not_over_keys": NearMiss("the softmax over dim -2 (the heads; the dense layout's queries)",
                                      "not over the keys", {"softmax": ("spelled",)}),
    "sink_per_key": NearMiss("one sink value per key, not per head", "is not one value per head",
                             {"softmax": ("spelled",)}),
    "fill_zero": NearMiss("invalid keys get 0, not -inf", "set to 0.0 where a key is dropped"),
    "values_not_keys": NearMiss("the values are the keys negated", "the values are not the keys"),
    "no_inverse_rope": NearMiss("the attention's output without its inverse RoPE", "(no inverse RoPE)"),
    "forward_rope": NearMiss("the output's tail rotated by +angle, not back", "rotated by +angle: not the inverse",
                             {"layout": ("gathered",)}),
    "rope_two_views": NearMiss("cos and sin taken of two views of the angles",
                               "the rotation's cos and sin are not of one angle tensor",
                               {"layout": ("gathered",)}, True),
    "rope_pairs_dense": NearMiss("the dense layout's inverse RoPE by pairs, not rotate-half",
                                 "not read as its even elements and its negated odd ones (rotate_half)",
                                 {"layout": ("dense",)}, True),
}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class SpelledAttention(nn.Module):
    """The attention `spelling` describes: forward(q, keys, valid, angles) -> out in the input dtype."""

    def __init__(self, spelling: Spelling):
        super().__init__()
        self.s = spelling
        g = torch.Generator().manual_seed(spelling.seed())
        self.sink = nn.Parameter(torch.randn(HEADS, generator=g).to(_dtype(spelling.sink_dtype)))
        self.sink_per_key = nn.Parameter(torch.randn(J if spelling.layout == "gathered" else S, generator=g))

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Random inputs in the layout's shapes; with many rows query (0, 0) sees no valid key.
        With mask "drop_mask" the mask is passed as True where a key is dropped."""
        s, g = self.s, torch.Generator().manual_seed(self.s.seed() + 1)
        dtype, many = _dtype(s.dtype), s.rows == "many"
        b, t = (B, T if s.layout == "gathered" else DENSE_T) if many else (1, 1)
        if s.layout == "gathered":
            q = torch.randn(b, t, HEADS, HEAD_DIM, generator=g)
            keys = torch.randn(b, t, J, HEAD_DIM, generator=g)
            valid = torch.rand(b, t, J, generator=g) < 0.7
            angles = torch.rand(b, t, ROPE_DIM // 2, generator=g) * 100
        else:
            q = torch.randn(b, HEADS, t, HEAD_DIM, generator=g)
            keys = torch.randn(b, S, HEAD_DIM, generator=g)
            valid = torch.rand(b, t, S, generator=g) < 0.7
            angles = torch.rand(1, t, ROPE_DIM // 2, generator=g) * 100
        if many:
            valid[0, 0] = False
        else:
            valid[0, 0, 0] = True  # a key to attend to
        if s.mask_rows == "shared":
            valid = valid[0]
        return q.to(dtype), keys.to(dtype), ~valid if s.mask == "drop_mask" else valid, angles

    def forward(self, q, keys, valid, angles):
        s = self.s
        if s.upcast == "inputs":
            q, keys = q.float(), keys.float()
        scores = self.scores(q, keys)
        if s.upcast == "scores":
            scores = scores.float()
        scores = scores * HEAD_DIM ** -0.5 if s.scale == "mul" else scores / math.sqrt(HEAD_DIM)
        o = self.values(self.softmax(self.masked(scores, valid)), keys)
        return self.derotate(o, angles).to(_dtype(s.dtype))

    def scores(self, q, keys):
        s = self.s
        if s.layout == "gathered":
            if s.scores == "einsum":
                return torch.einsum("bthd,btjd->bthj", q, keys)
            return q @ keys.transpose(-1, -2)
        if s.scores == "einsum":
            return torch.einsum("bhtd,bsd->bhts", q, keys)
        if s.scores == "expand":  # the key head repeated for every query head, as repeat_kv does
            return q @ keys[:, None].expand(-1, HEADS, -1, -1).transpose(2, 3)
        return q @ keys[:, None].transpose(-1, -2)  # broadcast over the heads by matmul

    def values(self, p, keys):
        s = self.s
        if s.near_miss == "values_not_keys":
            keys = -keys
        if s.layout == "gathered":
            keys = keys.float()
            return torch.einsum("bthj,btjd->bthd", p, keys) if s.scores == "einsum" else p @ keys
        if s.upcast == "scores":
            p = p.to(keys.dtype)  # P V in 16 bits, as HF's eager attention
        return torch.einsum("bhts,bsd->bhtd", p, keys) if s.scores == "einsum" else p @ keys[:, None]

    def masked(self, scores, valid):
        s = self.s
        v = valid[:, :, None, :] if s.layout == "gathered" else valid if valid.dim() == 2 else valid[:, None]
        if s.near_miss == "fill_zero":
            return scores.masked_fill(~v, 0.0)
        if s.mask == "masked_fill":
            return scores.masked_fill(~v, NEG_INF)
        if s.mask == "where_valid":
            return torch.where(v, scores, NEG_INF)
        if s.mask == "logical_not":
            return scores.masked_fill(v.logical_not(), NEG_INF)
        if s.mask == "additive":
            return scores + torch.where(v, 0.0, NEG_INF)
        if s.mask == "finfo_min":
            return scores.masked_fill(~v, torch.finfo(scores.dtype).min)
        return scores.masked_fill(v, NEG_INF)  # drop_mask: True where a key is dropped

    def sink_b(self):
        """The sink shaped to broadcast against the scores along their heads dim."""
        s, sink = self.s, self.sink.float()
        if s.near_miss == "sink_per_key":
            return self.sink_per_key
        gathered = s.layout == "gathered"
        if s.sink == "view":
            return sink.view(1, 1, HEADS, 1) if gathered else sink.view(1, HEADS, 1, 1)
        if s.sink == "reshape":
            return sink.reshape(-1, 1) if gathered else sink.reshape(-1, 1, 1)
        if s.sink == "index":
            return sink[None, None, :, None] if gathered else sink[None, :, None, None]
        return sink.unsqueeze(-1) if gathered else sink.unsqueeze(-1).unsqueeze(-1)

    def rowmax(self, x):
        how = self.s.rowmax
        if how == "amax":
            return x.amax(dim=-1, keepdim=True)
        if how == "max_values":
            return torch.max(x, dim=-1, keepdim=True).values
        return x.max(-1).values[..., None]

    def softmax(self, scores):
        s, sink = self.s, self.sink_b()
        dim = -2 if s.near_miss == "softmax_not_over_keys" else -1
        if s.near_miss == "no_sink":
            return scores.softmax(-1)
        if s.softmax != "spelled":
            x = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
            if s.softmax == "column":
                return F.softmax(x, dim=-1)[..., :-1]
            e = torch.exp(x - self.rowmax(x))
            return (e / e.sum(dim=-1, keepdim=True))[..., :-1]
        m = scores.amax(dim=dim, keepdim=True) if dim != -1 else self.rowmax(scores)
        if s.max == "with_sink":
            m = {"maximum": torch.maximum, "max": torch.max, "clamp": lambda a, b: a.clamp(min=b)}[s.maximum](m, sink)
        e = torch.exp(scores - m)
        total = e.sum(dim=dim, keepdim=True)
        if s.near_miss == "sink_only_in_max":
            return e / total
        term = torch.exp(sink - m)
        return e / (total + term if s.denominator == "sum_first" else term + total)

    def derotate(self, o, angles):
        """The inverse RoPE of o's last ROPE_DIM dims, then joined with the rest; in fp32 for the
        gathered layout (pairs), in o's dtype for the dense one (rotate-half, HF's way)."""
        if self.s.near_miss == "no_inverse_rope":
            return o
        rd, near = 2 * angles.shape[-1], self.s.near_miss
        kept, r = o[..., :-rd], o[..., -rd:]
        if self.s.layout == "gathered" or near == "rope_pairs_dense":
            pairs = r.reshape(*r.shape[:-1], rd // 2, 2)
            x, y = pairs[..., 0], pairs[..., 1]
            per_head = angles[:, :, None] if self.s.layout == "gathered" else angles[:, None]
            cos, sin = per_head.cos(), per_head.sin()
            if near == "rope_two_views":
                sin = angles[:, :, None].sin()
            if near == "forward_rope":
                turned = torch.stack([x * cos - y * sin, x * sin + y * cos], dim=-1)
            elif self.s.rotation == "plus_sin":
                turned = torch.stack([x * cos + y * sin, y * cos - x * sin], dim=-1)
            else:
                sin = -sin
                turned = torch.stack([x * cos - y * sin, x * sin + y * cos], dim=-1)
            return torch.cat([kept, turned.reshape(r.shape)], dim=-1)
        cos = angles.cos().repeat_interleave(2, dim=-1)[:, None].to(o.dtype)
        sin = (-angles.sin()).repeat_interleave(2, dim=-1)[:, None].to(o.dtype)
        half = torch.stack([-r[..., 1::2], r[..., 0::2]], dim=-1).flatten(-2)
        return torch.cat([kept, r * cos + half * sin], dim=-1)


def reference(module: SpelledAttention, q, keys, valid, angles) -> torch.Tensor:
    """The attention with the sink, its inverse RoPE, in fp64, in the module's output layout: the
    sink as the softmax's last column (no max to choose), the rotation by its matrix."""
    s = module.s
    if s.mask == "drop_mask":
        valid = ~valid
    valid = valid.expand(q.shape[0], -1, -1)  # a mask shared by the sequences
    if s.layout == "dense":  # each query with its sequence's keys
        q, keys = q.transpose(1, 2), keys[:, None].expand(-1, q.shape[2], -1, -1)
        angles = angles.expand(q.shape[0], -1, -1)
    q, keys, angles, sink = (t.double() for t in (q, keys, angles, module.sink))
    scores = torch.einsum("bthd,btjd->bthj", q, keys) * HEAD_DIM ** -0.5
    scores = scores.masked_fill(~valid[:, :, None, :], NEG_INF)
    x = torch.cat([scores, sink[:, None].expand(*scores.shape[:-1], 1)], dim=-1)
    o = torch.einsum("bthj,btjd->bthd", torch.softmax(x, dim=-1)[..., :-1], keys)
    rd = 2 * angles.shape[-1]
    pairs = o[..., -rd:].unflatten(-1, (rd // 2, 2))
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    turned = torch.stack([pairs[..., 0] * cos + pairs[..., 1] * sin, pairs[..., 1] * cos - pairs[..., 0] * sin], -1)
    out = torch.cat([o[..., :-rd], turned.flatten(-2)], dim=-1)
    return out.transpose(1, 2) if s.layout == "dense" else out


# ---- the checks -----------------------------------------------------------------------------------

# The chain's ops: none is left in a fused graph (the op reads the inputs through views, and the
# sink widened to fp32).
CHAIN_OPS = ("aten.bmm", "aten.mm.", "aten.exp", "aten.amax", "aten.max.", "aten.maximum", "aten.clamp",
             "aten.sum", "aten.sub", "aten.div", "aten.where", "aten.cat", "aten.cos", "aten.sin", "aten.neg",
             "prepare_softmax_online", "aten.constant_pad_nd")
FP32_CHAIN = 2.0 ** -17  # the fp32 computation's error bound, relative to the largest output


def allowed_error(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an output rounded to `dtype` from an fp32 computation may differ from the exact `ref`,
    element by element: half a unit in the last place of the value (2^-8 relative in bf16, 2^-24
    in fp32), and the fp32 chain's few hundred roundings, within FP32_CHAIN of the largest output."""
    return torch.finfo(dtype).eps / 2 * ref.abs() + FP32_CHAIN * ref.abs().max()


def run(spelling: Spelling):
    """(the module fused (passes: mega_attention) in the spelling's graph form, its output, the
    eager module's output, the fp64 reference), on the spelling's inputs."""
    module = SpelledAttention(spelling)
    args = module.inputs()
    with torch.no_grad(), inductor_config.patch(TORCH_2_11_FORMS if spelling.graph == "cuda" else {}):
        fused = fuse(module, ["mega_attention"], fullgraph=True)
        out, eager = fused(*args), module(*args)
    return fused, out, eager, reference(module, *args)


def check_fused(spelling: Spelling) -> dict:
    """Asserts `spelling` fuses exactly once, its chain's ops gone, its output the reference's within
    the output's rounding (a query without a valid key exactly 0), and the eager module the same
    function (where the plain max gives that query NaN, the fused output gives it 0); its spec."""
    fused, out, eager, ref = run(spelling)
    report = fused.report
    assert report.counts() == {"mega_attention": 1}, ([r.reason for r in report.rejections("mega_attention")], spelling)
    graph = fused.post_grad_graphs[0]
    assert graph.count("megafuse.mega_attention") == 1
    assert not [op for op in CHAIN_OPS if op in graph], ([op for op in CHAIN_OPS if op in graph], spelling)
    dtype = _dtype(spelling.dtype)
    assert out.dtype == eager.dtype == dtype and out.shape == eager.shape == ref.shape
    assert bool(((out.double() - ref).abs() <= allowed_error(ref, dtype)).all()), spelling
    if spelling.rows == "many":  # query (0, 0) sees no valid key: exactly 0
        dead = ref[0, :, 0] if spelling.layout == "dense" else ref[0, 0]
        assert not dead.any() and not (out[0, :, 0] if spelling.layout == "dense" else out[0, 0]).any()
    nan = eager.isnan()
    assert not nan.any() or spelling.max == "plain" and spelling.softmax == "spelled", spelling
    # eager rounds the scores to 16 bits where the spelling does (the kernel does not): a few % there
    close = (eager.double() - ref).abs() <= (2.0 ** -5 * ref.abs().max() if spelling.rounds_scores
                                              else allowed_error(ref, dtype))
    assert bool((close | nan).all()), spelling
    return report.matches("mega_attention")[0].spec


def check_near_miss(spelling: Spelling) -> None:
    """Asserts the near miss `spelling` stays unfused with its reason, and runs as eager does."""
    fused, out, eager, _ = run(spelling)
    reasons = [r.reason for r in fused.report.rejections("mega_attention")]
    assert fused.report.counts() == {"mega_attention": 0}, spelling
    assert len(reasons) == 1 and NEAR_MISSES[spelling.near_miss].reason in reasons[0], (reasons, spelling)
    assert "megafuse.mega_attention" not in fused.post_grad_graphs[0]
    torch.testing.assert_close(out, eager, equal_nan=True)
