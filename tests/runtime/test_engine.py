"""The engine against the plain model: exact mode is exact, nothing is lost, cached pages are read-only."""

import hashlib
import logging
import math

import pytest
import torch

from megafuse.model import CacheLayout, KVCache
from megafuse.runtime import Engine, RequestError, SamplingParams
from megafuse.runtime import engine as engine_module
from tests.model.stepping import random_tokens

NEW_TOKENS = 4


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """The plain model recomputing the whole sequence for every token."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def _sessions(cfg):
    """6 sessions over one 100-token system prompt; a second turn appends the output and a tool result."""
    system = random_tokens(cfg, 100, seed=20)
    return [system + random_tokens(cfg, 6 + i, seed=30 + i) for i in range(6)], \
        [random_tokens(cfg, 9 + i, seed=40 + i) for i in range(6)]


def test_exact_mode_generates_the_plain_models_greedy_tokens_through_hits_evictions_and_preemptions(tiny_fp32, tiny_model):
    first_turns, tool_results = _sessions(tiny_fp32)
    # 3 slots, 18 pages of 8 tokens: the 13 pages of the shared system prompt and a few of each
    # request's own; requests evict cached pages, and a decode that crosses a page boundary preempts
    layout = CacheLayout(slots=3, pages=18, page_size=8, max_pages=17)
    engine = Engine(tiny_model, layout=layout, passes=None, swa_bounded_replay=False, trim_decoder=False, token_budget=64)
    outputs = engine.generate(first_turns, NEW_TOKENS)
    second_turns = [p + o + t for p, o, t in zip(first_turns, outputs, tool_results)]
    outputs += engine.generate(second_turns, NEW_TOKENS)
    for prompt, output in zip(first_turns + second_turns, outputs):
        assert output == _greedy(tiny_model, prompt, NEW_TOKENS)
    stats = engine.stats
    print(stats)
    assert stats.prefix_hits >= 6 and stats.evictions >= 1 and stats.preemptions >= 1
    assert stats.replayed_tokens > 0 and stats.trimmed_tokens == 0


def test_bounded_mode_against_exact_mode_is_measured_per_token(tiny_fp32, tiny_model):
    first_turns, tool_results = _sessions(tiny_fp32)
    layout = CacheLayout(slots=3, pages=64, page_size=8, max_pages=17)

    def run(**mode):
        engine = Engine(tiny_model, layout=layout, passes=None, token_budget=64, keep_logits=True, **mode)
        outputs = engine.generate(first_turns, NEW_TOKENS)
        outputs += engine.generate([p + o + t for p, o, t in zip(first_turns, outputs, tool_results)], NEW_TOKENS)
        return [r for r in engine.requests.values()], engine.stats

    exact, _ = run(swa_bounded_replay=False, trim_decoder=False)
    bounded, stats = run(swa_bounded_replay=True, trim_decoder=True)
    kls, agree, total = [], 0, 0
    for e, b in zip(exact, bounded):
        for k, (le, lb) in enumerate(zip(e.logits, b.logits)):
            total += 1
            agree += e.output[k] == b.output[k]
            if e.output[:k] == b.output[:k]:  # same inputs so far: the distributions compare
                kls.append(torch.nn.functional.kl_div(lb.log_softmax(-1), le.log_softmax(-1), log_target=True,
                                                      reduction="sum").item())
    mean_kl, top1 = sum(kls) / len(kls), agree / total
    print(f"bounded vs exact over {total} tokens: top-1 agreement {top1:.3f}, mean KL {mean_kl:.4f} "
          f"(max {max(kls):.4f}, {len(kls)} positions); {stats}")
    assert stats.trimmed_tokens > 0 and stats.replayed_tokens == stats.prefix_hits * tiny_fp32.window
    # Measured on these sessions (tiny's random weights give near-flat distributions, so a tiny KL
    # can still flip a greedy choice, and every later token then sees other inputs): top-1
    # agreement 0.854 over 48 tokens, mean KL 2e-4 (max 2.1e-3) over the 43 positions whose inputs
    # agree. Bounds: about 5x the KLs, and top-1 at 0.7.
    assert mean_kl <= 1e-3 and max(kls) <= 1e-2 and top1 >= 0.7


def test_a_burst_of_50_requests_on_a_cache_for_5_loses_none_and_bad_requests_get_named_errors(tiny_fp32, tiny_model):
    prompts = [random_tokens(tiny_fp32, 5 + i % 7, seed=100 + i) for i in range(50)]
    layout = CacheLayout(slots=5, pages=10, page_size=8, max_pages=4)
    engine = Engine(tiny_model, layout=layout, passes=None, token_budget=32)
    bad = [([], 3, None, "prompt is empty"),
           ([tiny_fp32.vocab_size], 3, None, "outside 0..1023"),
           ([1, 2], 0, None, "max_new_tokens must be a positive int"),
           ([1] * 40, 3, None, "needs 42 positions; the cache holds at most 32"),
           ([1, 2], 3, SamplingParams(temperature=-1.0), "temperature must be >= 0"),
           ([1, 2], 3, SamplingParams(top_p=0.0), r"top_p must lie in \(0, 1\]")]
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(engine.add_request(prompt, 4))
        if i % 10 == 0:
            prompt, n, sampling, message = bad[i // 10 % len(bad)]
            with pytest.raises(RequestError, match=message):
                engine.add_request(prompt, n, sampling)
    while engine.waiting or engine.running:
        engine.step()
    got = [engine.requests[i].output for i in ids]
    assert all(len(o) == 4 for o in got)
    clean = Engine(tiny_model, layout=layout, passes=None, token_budget=32).generate(prompts, 4)
    assert got == clean
    assert engine.pages.pool.refs == [0] * layout.pages  # every page released


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(tiny_fp32, tiny_model):
    layout = CacheLayout(slots=2, pages=8, page_size=8, max_pages=4)
    prompt = [random_tokens(tiny_fp32, 12, seed=7)]
    hot = SamplingParams(temperature=1.5, top_p=0.9, seed=3)
    a = Engine(tiny_model, layout=layout, passes=None).generate(prompt, 8, hot)
    b = Engine(tiny_model, layout=layout, passes=None).generate(prompt, 8, hot)
    c = Engine(tiny_model, layout=layout, passes=None).generate(prompt, 8, SamplingParams(temperature=1.5, top_p=0.9, seed=4))
    greedy = Engine(tiny_model, layout=layout, passes=None).generate(prompt, 8)
    nucleus_of_one = Engine(tiny_model, layout=layout, passes=None).generate(prompt, 8, SamplingParams(temperature=1.0, top_p=1e-6))
    assert a == b and a != c and nucleus_of_one == greedy


def test_cached_pages_are_read_only_across_replays(tiny_fp32, tiny_model):
    first_turns, _ = _sessions(tiny_fp32)
    layout = CacheLayout(slots=2, pages=64, page_size=8, max_pages=20)
    engine = Engine(tiny_model, layout=layout, passes=None, token_budget=64)
    engine.generate(first_turns[:1], 3)
    cached = sorted(engine.pages.hash_of)
    assert len(cached) == 13  # the 105-token prompt's 13 full pages (the last token's page is partial)

    def digest():
        return [hashlib.sha256(engine.cache.page_bytes(p)).hexdigest() for p in cached]

    before = digest()
    engine.generate(first_turns[1:], 3)  # each replays over the shared system-prompt pages
    assert engine.stats.prefix_hits == 5 and engine.stats.replayed_tokens == 5 * tiny_fp32.window
    assert digest() == before


def test_streams_yield_each_requests_tokens_as_they_come_while_serving_the_others(tiny_fp32, tiny_model):
    prompts = [random_tokens(tiny_fp32, 20 + 7 * i, seed=80 + i) for i in range(3)]
    layout = CacheLayout(slots=3, pages=24, page_size=8, max_pages=8)
    want = Engine(tiny_model, layout=layout, passes=None, token_budget=32).generate(prompts, 5)
    engine = Engine(tiny_model, layout=layout, passes=None, token_budget=32)
    first = engine.stream(prompts[0], 5)
    others = [engine.add_request(p, 5) for p in prompts[1:]]
    got, steps_per_token = [], []
    for token in first:  # each token arrives after the steps that made it, not at the end
        got.append(token)
        steps_per_token.append(engine.stats.steps)
    assert got == want[0] and steps_per_token == sorted(set(steps_per_token))
    while engine.waiting or engine.running:
        engine.step()
    assert [engine.requests[i].output for i in others] == want[1:]
    with pytest.raises(RequestError, match="empty"):
        engine.stream([], 3)  # a bad request fails when it is made, not at the first next()


def _allocated_bytes(cfg, slots: int, pages: int) -> int:
    return sum(KVCache.allocate(cfg, CacheLayout(slots=slots, pages=pages, page_size=64, max_pages=1)).nbytes().values())


def test_an_engine_without_a_layout_sizes_one_and_serves_the_same_tokens(tiny_fp32, tiny_model, caplog):
    prompts = [random_tokens(tiny_fp32, 9 + 5 * i, seed=60 + i) for i in range(3)]
    explicit = Engine(tiny_model, layout=CacheLayout(slots=3, pages=6, page_size=8, max_pages=4), passes=None,
                      token_budget=16)
    with caplog.at_level(logging.INFO, logger="megafuse.runtime"):
        default = Engine(tiny_model, passes=None, token_budget=16)
    assert default.generate(prompts, NEW_TOKENS) == explicit.generate(prompts, NEW_TOKENS)
    # on the CPU: 0.9 x CPU_CACHE_BYTES (1 GiB); one slot per row of the token budget; 4096 positions a request
    layout = default.layout
    assert (layout.slots, layout.page_size, layout.max_pages) == (16, 64, 4096 // 64)
    budget = math.floor(0.9 * 2**30)
    used = sum(default.cache.nbytes().values())
    assert used == layout.nbytes(tiny_fp32) and budget - 49152 < used <= budget  # within one page of the budget
    records = [r.getMessage() for r in caplog.records if r.name == "megafuse.runtime"]
    assert len(records) == 1 and records[0].startswith(
        f"cache layout: 16 slots, {layout.pages} pages of 64 tokens (up to 4096 tokens a request)"), records


def test_the_default_layouts_pages_follow_from_the_free_memory(tiny_fp32, tiny_model, monkeypatch):
    # tiny in fp32, quant none: raw fp32 rows. A slot: 12 layers x W=8 SWA rows of 64 x 4 B, plus the
    # pending (k, gate) of the two ratio-2 sources, 2 x 64 x 4 B each. A page of 64 positions: 32 + 32
    # + 64 entries of the kv sources 2, 4 (ratio 2) and 6 (ratio 1), each 64 x 4 B of KV + 32 x 4 B of key.
    per_slot, per_page = 12 * 8 * 64 * 4 + 2 * (2 * 64 * 4), (32 + 32 + 64) * (64 + 32) * 4
    assert (per_slot, per_page) == (25_600, 49_152)
    base = _allocated_bytes(tiny_fp32, 1, 1)  # and what allocating one more slot or page takes
    assert _allocated_bytes(tiny_fp32, 2, 1) - base == per_slot and _allocated_bytes(tiny_fp32, 1, 2) - base == per_page

    free = 7_777_777
    monkeypatch.setattr(engine_module, "device_free_bytes", lambda device: free)
    engine = Engine(tiny_model, passes=None, token_budget=4, memory_fraction=0.5, max_tokens=200)
    budget = math.floor(0.5 * free)
    pages = (budget - (4 + 1) * per_slot - per_page) // per_page  # the scratch slot and page count too
    assert pages == 75 and engine.layout == CacheLayout(slots=4, pages=75, page_size=64, max_pages=4)  # ceil(200 / 64)
    assert budget - per_page < sum(engine.cache.nbytes().values()) <= budget

    # cache_bytes is the budget itself; max_tokens beyond the pool is cut to the pool
    exact = Engine(tiny_model, passes=None, token_budget=4, cache_bytes=6 * per_slot + 4 * per_page, max_tokens=10_000)
    assert exact.layout == CacheLayout(slots=4, pages=3, page_size=64, max_pages=3)
    assert sum(exact.cache.nbytes().values()) == 6 * per_slot + 4 * per_page - per_slot  # 5 slots, 4 pages


@pytest.mark.parametrize("sizing, message", [
    (dict(memory_fraction=0.0), r"memory_fraction must lie in \(0, 1\] \(the share of the device's free memory"),
    (dict(memory_fraction=1.5), r"memory_fraction must lie in \(0, 1\]"),
    (dict(memory_fraction=float("nan")), r"memory_fraction must lie in \(0, 1\]"),
    (dict(cache_bytes=0), "cache_bytes must be a positive int"),
    (dict(cache_bytes=2**20, memory_fraction=0.5), "give cache_bytes .* or memory_fraction .*, not both"),
    (dict(max_tokens=0), "max_tokens must be a positive int"),
    # 4 slots + the scratch: 5 x 25,600 bytes, and two pages of 49,152 (one of them the scratch)
    (dict(cache_bytes=200_000), "a cache budget of 200,000 bytes holds no page of tiny: .* the smallest budget is "
                                "226,304 bytes"),
])
def test_invalid_default_layout_sizes_are_errors_naming_the_valid_range(tiny_model, sizing, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model, passes=None, token_budget=4, **sizing)


def test_a_given_layout_with_sizing_keywords_is_an_error():
    layout = CacheLayout(slots=2, pages=8, page_size=8, max_pages=4)
    with pytest.raises(ValueError, match="memory_fraction size the default layout; with a layout given they would do nothing"):
        Engine(torch.nn.Module(), layout=layout, memory_fraction=0.5)
