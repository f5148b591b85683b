"""Incremental decode with the eager cache reproduces one-shot prefill; the model is causal."""

import pytest
import torch

from megafuse.model import build_model, preset
from tests.marks import slow_beyond

SEQ = 72  # crosses the window (8), every ratio-2 group boundary and the candidate blocks (4 x 2)


def _ids(cfg, batch, length, seed):
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _decode_all(model, ids, prompt_len):
    cache = model.new_cache(ids.shape[0])
    outs = [model(ids[:, :prompt_len], cache)]
    for t in range(prompt_len, ids.shape[1]):
        outs.append(model(ids[:, t:t + 1], cache))
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("prompt_len", slow_beyond([1, 5]))
def test_incremental_decode_matches_prefill_at_every_position(tiny_fp32, tiny_model, prompt_len):
    ids = _ids(tiny_fp32, 2, SEQ, seed=1)
    full = tiny_model(ids)
    stepped, cache = _decode_all(tiny_model, ids, prompt_len)
    assert cache.length == SEQ
    err = (stepped - full).abs().amax(dim=(0, 2))  # per position
    assert err.max().item() <= 1e-4, f"worst position {err.argmax().item()}: {err.max().item():.3g}"
    assert full.std() > 0.1  # not a degenerate model that would hide errors


def test_chunked_prefill_matches_one_shot(tiny_fp32, tiny_model):
    ids = _ids(tiny_fp32, 1, 41, seed=2)
    full = tiny_model(ids)
    cache = tiny_model.new_cache(1)
    chunks = [tiny_model(ids[:, a:b], cache) for a, b in ((0, 11), (11, 12), (12, 30), (30, 41))]
    assert (torch.cat(chunks, 1) - full).abs().max().item() <= 1e-4


def test_decode_matches_prefill_with_reference_quantisation():
    cfg = preset("tiny").replace(quant="ref", dtype="float32")
    model = build_model(cfg, seed=3)
    ids = _ids(cfg, 1, 40, seed=3)
    full = model(ids)
    stepped, _ = _decode_all(model, ids, 3)
    # Both paths fake-quantise each row with the same code, but fp32 summation order differs by
    # ~1e-7, which can move a value across a rounding boundary of FP4/FP8: a whole grid step. So the
    # bound is looser than the unquantised 1e-4, and the greedy choice must agree everywhere.
    assert (stepped - full).abs().max().item() <= 2e-2
    assert torch.equal(stepped.argmax(-1), full.argmax(-1))


def test_appending_tokens_never_changes_earlier_logits(tiny_fp32, tiny_model):
    ids = _ids(tiny_fp32, 1, 48, seed=4)
    longer = torch.cat((ids, _ids(tiny_fp32, 1, 17, seed=5)), dim=1)
    assert (tiny_model(longer)[:, :48] - tiny_model(ids)).abs().max().item() <= 1e-5


def test_changing_a_later_token_changes_only_later_logits(tiny_fp32, tiny_model):
    ids = _ids(tiny_fp32, 1, 30, seed=6)
    edited = ids.clone()
    edited[0, 20] = (edited[0, 20] + 1) % tiny_fp32.vocab_size
    a, b = tiny_model(ids), tiny_model(edited)
    assert (a[:, :20] - b[:, :20]).abs().max().item() <= 1e-5
    assert (a[:, 20:] - b[:, 20:]).abs().amax(dim=-1).min().item() > 1e-4


def test_batch_rows_are_independent(tiny_fp32, tiny_model):
    ids = _ids(tiny_fp32, 3, 20, seed=7)
    together = tiny_model(ids)
    for b in range(3):
        assert (tiny_model(ids[b:b + 1]) - together[b:b + 1]).abs().max().item() <= 1e-4
