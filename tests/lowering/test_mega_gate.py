"""Mega-Gate kernel (lowering/mega_gate.py) against its torch reference, on CPU via the interpreter.

The kernel source is the one CUDA compiles; here the Triton interpreter runs it (atomics, the job
counter and the epilogue's spin included). Inputs are random but drawn from a grid (u in steps of
1/16, W in steps of 1/256, D <= 64) so every fp32 dot product is exact in any summation order: the
kernel's logits then equal the reference's bit for bit, and an id mismatch can only be a real
bug or an exact tie. Ties are detected in the reference's biased choice; tied rows must follow the
stable order (descending choice, then the lowest expert index), all other rows must equal
`torch.topk`'s selection exactly.
"""

import itertools

import pytest
import torch

from megafuse.lowering import kernel_cache
from megafuse.lowering import mega_gate as mg
from megafuse.lowering.mega_gate import GateSpec, LaunchConfig, generate_source, mega_gate, reference, unsupported_reason
from megafuse.model.moe import score

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
RENORMS = {"eps": (True, 1e-20), "no_eps": (True, 0.0), "none": (False, 0.0)}
SHAPES = ((24, 64, 4), (48, 40, 6), (16, 64, 3))  # (E, D, k): non-power-of-two E, D not a tile multiple
TOKENS = (1, 5, 33)


@pytest.fixture(autouse=True)
def _kernel_cache_in_tmp(tmp_path_factory):
    kernel_cache.set_cache_dir(tmp_path_factory.getbasetemp() / "kernels")
    yield
    kernel_cache.set_cache_dir(None)


def make_spec(E=24, D=64, k=4, score_func="sqrtsoftplus", bias=True, renorm="eps", scale=1.5,
              dtype="float32", weight_dtype=None, **roundings):
    renorm_on, eps = RENORMS[renorm]
    return GateSpec(n_experts=E, hidden=D, k=k, score_func=score_func, has_bias=bias, renorm=renorm_on,
                    renorm_eps=eps, scale=scale, input_dtype=dtype, weight_dtype=weight_dtype or dtype, **roundings)


def grid_inputs(spec, T, seed):
    """Random inputs on a grid that makes every dot product exact in fp32 (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(-32, 33, (T, spec.hidden), generator=g) / 16
    w = torch.randint(-16, 17, (spec.n_experts, spec.hidden), generator=g) / 256
    b = (torch.randn(spec.n_experts, generator=g) * 0.05).to(mg.DTYPES[spec.bias_dtype]) if spec.has_bias else None
    return u.to(mg.DTYPES[spec.input_dtype]), w.to(mg.DTYPES[spec.weight_dtype]), b


def assert_matches_reference(spec, u, w, b, weights, ids):
    T, k = u.shape[0], spec.k
    assert weights.shape == (T, k) and weights.dtype == torch.float32
    assert ids.shape == (T, k) and ids.dtype == torch.int64
    assert torch.isfinite(weights).all()
    ref_w, ref_ids = reference(u, w, b, spec)
    # the choice the chain ranks, rounded where the spec says the chain rounds
    logits = (u.float() @ w.float().t()).to(mg.DTYPES[spec.logits_dtype]).float()
    choice = score(logits, spec.score_func, mg.DTYPES[spec.score_dtype])
    if b is not None:
        choice = choice + b.float()
    choice = choice.to(mg.DTYPES[spec.choice_dtype]).float()
    # a row is tied when two of its top-(k+1) reference choices are exactly equal
    top = choice.sort(dim=1, descending=True).values[:, :min(k + 1, spec.n_experts)]
    tied = (top[:, 1:] == top[:, :-1]).any(dim=1)
    assert torch.equal(ids[~tied], ref_ids[~tied]), "selection differs from torch.topk on untied rows"
    stable = choice.sort(dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(ids[tied], stable[tied]), "ties must resolve to the lowest expert index"
    if (~tied).any():
        tol = 1e-5 if spec.input_dtype == spec.weight_dtype == "float32" else 1e-2
        err = (weights[~tied] - ref_w[~tied]).norm() / ref_w[~tied].norm()
        assert err <= tol, f"weights rel. error {err:.2e} > {tol}"
    return int(tied.sum())


# Every variant of the chain, each with one of the shapes, token counts and kernel variants in
# rotation, so that every (shape, T, variant) occurs many times across the 72 cases.
VARIANTS = list(itertools.product(SCORE_FUNCS, (True, False), tuple(RENORMS), (1.5, 1.0), ("float32", "bfloat16")))


@pytest.mark.parametrize("case", range(len(VARIANTS)),
                         ids=["-".join(map(str, v)) for v in VARIANTS])
def test_every_variant_matches_reference(case):
    score_func, bias, renorm, scale, dtype = VARIANTS[case]
    E, D, k = SHAPES[case % len(SHAPES)]
    T = TOKENS[(case // 2) % len(TOKENS)]
    variant = ("split", "tiled")[case % 2]
    spec = make_spec(E, D, k, score_func, bias, renorm, scale, dtype)
    u, w, b = grid_inputs(spec, T, seed=case)
    weights, ids = mega_gate(u, w, b, spec, variant=variant)
    assert_matches_reference(spec, u, w, b, weights, ids)


@pytest.mark.parametrize("variant", ["split", "tiled"])
@pytest.mark.parametrize("E,k", [(24, 1), (12, 12)], ids=["k=1", "k=E"])
def test_k_equals_one_and_k_equals_E(variant, E, k):
    for i, T in enumerate(TOKENS):
        spec = make_spec(E, 40, k, SCORE_FUNCS[i], bias=bool(i % 2), renorm="eps" if i else "none")
        u, w, b = grid_inputs(spec, T, seed=100 + i)
        weights, ids = mega_gate(u, w, b, spec, variant=variant)
        assert_matches_reference(spec, u, w, b, weights, ids)
        if k == E:  # every expert exactly once, padding experts never
            assert torch.equal(ids.sort(dim=1).values, torch.arange(E).expand(T, E))


# (input, weight, bias, logits, score, choice) dtypes, as cast models produce them
ROUNDINGS = {
    "hf_bf16": ("bfloat16",) * 6,  # HF DeepseekV4 after .to(bfloat16): sqrt(softplus) rounds twice
    "ours_bf16": ("bfloat16", "bfloat16", "bfloat16", "float32", "float32", "float32"),  # route upcasts
    "half": ("float16", "float16", "float32", "float16", "float16", "float32"),  # .half(), an fp32 bias buffer
    "mixed": ("float16", "float32", "bfloat16", "float32", "float32", "float32"),
    "scores_cast_down": ("float32", "float32", "float32", "float32", "bfloat16", "bfloat16"),
}


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("dtypes", ROUNDINGS.values(), ids=ROUNDINGS.keys())
def test_rounding_dtypes_select_exactly_as_the_rounded_chain(dtypes, score_func):
    names = ("dtype", "weight_dtype", "bias_dtype", "logits_dtype", "score_dtype", "choice_dtype")
    spec = make_spec(24, 64, 4, score_func, **dict(zip(names, dtypes)))
    u, w, b = grid_inputs(spec, 33, seed=len(score_func))
    for variant in ("split", "tiled"):
        assert_matches_reference(spec, u, w, b, *mega_gate(u, w, b, spec, variant=variant))


def test_the_kernel_rounds_to_16_bits_as_torch_casts_do(tmp_path):
    """To nearest, ties to even, subnormals, overflow, NaN: exactly torch's casts (the Triton
    interpreter's own fp32 -> bf16 cast truncates, which would select other experts)."""
    kernel_cache.set_cache_dir(tmp_path)
    source = generate_source(make_spec()) + """

@triton.jit
def round_both(x_ptr, bf16_ptr, fp16_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(bf16_ptr + offs, _round_bfloat16(x))
    tl.store(fp16_ptr + offs, _round_float16(x))
"""
    kernel = kernel_cache.load_kernel(kernel_cache.write_source("rounding_probe", source), "round_both", True)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * scale for scale in (1.0, 1e-5, 3e4, 1e-7)])
    x[:16] = torch.tensor([65504.0, 65519.0, 65520.0, -65520.0, 6.1e-5, float("inf"), float("nan"), -0.0,
                           1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11,  # halfway: ties to even
                           1.5 * 2 ** -24, 2.5 * 2 ** -24, -(1 + 2 ** -8), 2 ** -25])
    bf16, fp16 = torch.empty_like(x), torch.empty_like(x)
    kernel[(1,)](x, bf16, fp16, x.numel())
    torch.testing.assert_close(bf16, x.bfloat16().float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(fp16, x.half().float(), rtol=0, atol=0, equal_nan=True)


def test_mixed_dtypes_upcast_to_fp32():
    spec = make_spec(24, 64, 4, "softmax", dtype="bfloat16", weight_dtype="float32")
    u, w, b = grid_inputs(spec, 5, seed=7)
    assert_matches_reference(spec, u, w, b, *mega_gate(u, w, b, spec))


@pytest.mark.parametrize("variant", ["split", "tiled"])
def test_exact_ties_resolve_to_the_lowest_index(variant):
    spec = make_spec(24, 64, 3, "sigmoid", bias=False, renorm="eps", scale=1.0)
    u, w, _ = grid_inputs(spec, 5, seed=3)
    u = u.abs()
    w[[4, 9, 17, 21]] = 1 / 16  # four identical, dominant experts for three slots
    weights, ids = mega_gate(u, w, None, spec, variant=variant)
    assert ids.tolist() == [[4, 9, 17]] * 5
    assert torch.allclose(weights, torch.full((5, 3), 1 / 3))


def test_random_normal_inputs_match_except_near_ties():
    """Off the exact grid: logits differ in the last bits, so only near-tie rows may differ."""
    spec = make_spec(48, 64, 6, "sqrtsoftplus")
    g = torch.Generator().manual_seed(11)
    u, w, b = torch.randn(33, 64, generator=g), torch.randn(48, 64, generator=g) / 8, torch.randn(48, generator=g) * 0.05
    ref_w, ref_ids = reference(u, w, b, spec)
    choice = score(u @ w.t(), spec.score_func) + b
    top = choice.sort(dim=1, descending=True).values[:, :7]
    near_tie = ((top[:, 1:] - top[:, :-1]).abs() < 1e-5).any(dim=1)
    for variant in ("split", "tiled"):
        weights, ids = mega_gate(u, w, b, spec, variant=variant)
        same = (ids == ref_ids).all(dim=1)
        assert (same | near_tie).all()
        assert (weights[same] - ref_w[same]).norm() / ref_w[same].norm() <= 1e-5


def test_zero_tokens_give_empty_outputs():
    spec = make_spec()
    u, w, b = grid_inputs(spec, 0, seed=0)
    weights, ids = mega_gate(u, w, b, spec)
    assert weights.shape == (0, 4) and ids.shape == (0, 4) and ids.dtype == torch.int64


def test_job_numbers_from_program_ids_when_the_grid_fits(monkeypatch):
    """With no more programs than SMs the kernel skips the claim counter (CLAIM_JOBS=False)."""
    monkeypatch.setattr(mg, "_num_sms", lambda device: 10 ** 6)
    spec = make_spec(24, 64, 4, "softmax", bias=True, renorm="no_eps")
    u, w, b = grid_inputs(spec, 33, seed=21)
    assert_matches_reference(spec, u, w, b, *mega_gate(u, w, b, spec, variant="split"))


def test_sync_state_is_left_all_zero():
    spec = make_spec(24, 64, 4)
    u, w, b = grid_inputs(spec, 33, seed=5)
    for variant in ("split", "tiled"):
        mega_gate(u, w, b, spec, variant=variant)
        assert mg.sync_state_is_clear("cpu")


def test_dirty_sync_state_is_reset_with_a_warning():
    spec = make_spec(24, 64, 4)
    u, w, b = grid_inputs(spec, 5, seed=6)
    mega_gate(u, w, b, spec)
    mg._states["cpu"].sync[0] = 7  # as if a launch had been aborted mid-way
    with pytest.warns(UserWarning, match="dirty"):
        weights, ids = mega_gate(u, w, b, spec)
    assert_matches_reference(spec, u, w, b, weights, ids)


def test_launch_config_override_and_validation():
    spec = make_spec(24, 64, 4)
    u, w, b = grid_inputs(spec, 33, seed=8)
    cfg = LaunchConfig(block_t=16, block_e=16, block_d=16, d_per_split=16, epi_rows=2)  # 2 expert chunks, 4 slices
    assert_matches_reference(spec, u, w, b, *mega_gate(u, w, b, spec, config=cfg))
    with pytest.raises(ValueError, match="inconsistent launch config"):
        mega_gate(u, w, b, spec, config=LaunchConfig(16, 16, 32, 16, 2))


def test_cuda_configs_fill_the_h200_and_keep_few_binaries():
    spec = make_spec(384, 5120, 6)
    grids = {}
    for T in (1, 16, 64, 128, 512, 2048, 4096):
        cfg = mg.choose_config(spec, T, device="cuda")
        assert cfg.d_per_split % cfg.block_d == 0 and cfg.block_t % cfg.epi_rows == 0
        assert cfg.variant(spec.hidden) == "split"
        n_t, n_e, n_d = -(-T // cfg.block_t), -(-384 // cfg.block_e), -(-5120 // cfg.d_per_split)
        grids[T] = n_t * n_e * n_d + -(-T // cfg.epi_rows)
    assert grids[1] <= 132  # decode: no job claiming needed on a 132-SM H200
    assert mg.choose_config(spec, 4096, device="cuda", variant="tiled").variant(spec.hidden) == "tiled"
    widths = {mg.choose_config(spec, T, device="cuda").d_per_split for T in range(1, 2049)}
    assert len(widths) <= 8


def test_shape_dtype_and_bias_mismatches_raise():
    spec = make_spec(24, 64, 4)
    u, w, b = grid_inputs(spec, 5, seed=9)
    cases = [
        ((u[:, :32], w, b), "u must be"),
        ((u, w[:20], b), "weight must be"),
        ((u.double(), w, b), "u dtype"),
        ((u, w.bfloat16(), b), "weight dtype"),
        ((u, w, None), "has_bias=True"),
        ((u, w, b[:10]), "bias must be"),
        ((u, w, b.double()), "bias must be"),
        ((u[0], w, b), "u must be"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            mega_gate(*args, spec)
    with pytest.raises(ValueError, match="has_bias=False"):
        mega_gate(u, w, b, make_spec(24, 64, 4, bias=False))


def test_unsupported_specs_give_a_reason():
    assert unsupported_reason(make_spec()) is None
    cases = {
        "top-k of 17": make_spec(E=64, k=17),
        "1025 experts": make_spec(E=1025, k=4),
        "not one of": make_spec(score_func="relu"),
        "float64": make_spec(dtype="float64"),
        "valid selection": make_spec(E=4, k=5),
        "precision": GateSpec(24, 64, 4, "sigmoid", False, False, 0.0, 1.0, "float32", "float32", "bf16x9"),
        "eps": make_spec(renorm="eps").__class__(24, 64, 4, "sigmoid", False, True, -1.0, 1.0, "float32", "float32"),
    }
    for fragment, spec in cases.items():
        reason = unsupported_reason(spec)
        assert reason and fragment in reason, (fragment, reason)
        with pytest.raises(ValueError, match="unsupported|cannot generate"):
            generate_source(spec)


def test_generated_source_is_specialised_per_spec():
    base = make_spec(24, 64, 4, "sqrtsoftplus", bias=True, renorm="eps", scale=1.5)
    variants = [base, make_spec(24, 64, 4, "sigmoid"), make_spec(24, 64, 4, "softmax"),
                make_spec(bias=False), make_spec(renorm="no_eps"), make_spec(renorm="none"),
                make_spec(scale=1.0), make_spec(dtype="bfloat16"), make_spec(E=48), make_spec(k=5)]
    sources = [generate_source(s) for s in variants]
    assert len(set(sources)) == len(sources) and len({s.key() for s in variants}) == len(variants)
    src = sources[0]
    assert "N_EXPERTS = tl.constexpr(24)" in src and "E_PAD = tl.constexpr(32)" in src
    assert "bias_ptr + cols" in src and "1e-20" in src and "* 1.5" in src and 'input_precision="tf32x3"' in src
    assert "bias_ptr + cols" not in generate_source(make_spec(bias=False))
    assert "weights = weights /" not in generate_source(make_spec(renorm="none"))
    assert "route scale" not in generate_source(make_spec(scale=1.0))
    assert "input_precision" not in generate_source(make_spec(dtype="bfloat16")).split("def _gemm_job")[1].split("def _epilogue_job")[0].replace("INTERPRETED", "")
    assert base.key() == make_spec(24, 64, 4, "sqrtsoftplus", bias=True, renorm="eps", scale=1.5).key()
    assert base.describe()["key"] == base.key() and base.describe()["e_pad"] == 32


def test_source_is_cached_on_disk_and_reused(tmp_path):
    kernel_cache.set_cache_dir(tmp_path)
    spec = make_spec(24, 64, 4, "sigmoid", bias=False)
    u, w, _ = grid_inputs(spec, 5, seed=12)
    mega_gate(u, w, None, spec)
    path = tmp_path / f"{mg.kernel_name(spec)}.py"
    assert path.read_text() == generate_source(spec)
    mtime = path.stat().st_mtime_ns
    kernel = mg.load(spec, interpret=True)
    mega_gate(u, w, None, spec)
    assert path.stat().st_mtime_ns == mtime and mg.load(spec, interpret=True) is kernel
    assert [r["name"] for r in kernel_cache.list_generated()] == [path.stem]
    assert kernel_cache.list_generated()[0]["loaded"] == ["interpreter"]


def test_reference_is_model_route(monkeypatch):
    from megafuse.model import moe

    assert mg.route is moe.route  # the math exists once
    calls = []
    monkeypatch.setattr(mg, "route", lambda *a, **kw: calls.append(kw) or "routed")
    spec = make_spec(24, 64, 4, "softmax", renorm="no_eps", scale=2.0)
    assert reference(None, None, None, spec) == "routed"
    assert calls == [dict(score_func="softmax", k=4, renorm=True, scale=2.0, renorm_eps=0.0,
                          logits_dtype=torch.float32, score_dtype=torch.float32, choice_dtype=torch.float32)]
