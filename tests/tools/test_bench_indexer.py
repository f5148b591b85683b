"""tools/bench_indexer.py on the CPU: the dry run fuses the step's indexer chain once through
`passes.compile` and every way's top-k equals fp64's; the floor's bytes; the fp64 top-k against a
brute-force one, exact ties and invisible entries included; a near tie is told from a wrong choice."""

import json
import re

import pytest
import torch

from megafuse.model import preset
from megafuse.model.attention import NEG_INF, visible_entries
from megafuse.model.cache import row_codec
from megafuse.tools import bench_indexer
from megafuse.tools.bench_indexer import SCHEMA, compare_sets, floor_bytes, fp64_scores, fp64_topk, main, \
    make_inputs, plain_ratio
from tests.tools.schemas import documented_schema


def test_the_dry_run_fuses_once_and_every_way_chooses_fp64s_top_k(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == SCHEMA and r["dry_run"]
    assert r["fused"]["counts"] == {"mega_indexer": 1} and r["fused"]["rejections"] == []
    spec = r["fused"]["specs"][0]
    assert (spec["heads"], spec["head_dim"], spec["topk"], spec["ratio"], spec["per_page"], spec["allowed"]) == \
        (4, 32, 6, 2, 8, False)
    assert r["compile"]["counts"] == {}
    for way in ("fused", "compile", "eager"):
        assert r["correctness"][way]["rows"] == 3 and r["correctness"][way]["differing_rows"] == 0, way
    assert all(stage["ok"] for stage in r["stages"].values())
    assert not any(k.startswith("time_") for k in r) and "summary" not in r  # no timings on the CPU
    # batch 3, 64 tokens at ratio 2: 32 entries of 16 + 1 bytes (MXFP4 at 32 dims: one scale); bf16 q
    assert r["row_bytes"] == 17 and r["dtype"] == "bfloat16"
    assert r["floor"]["bytes"]["total"] == 3 * 32 * 17 + 3 * 4 * 32 * 2 + 3 * 4 * 4 + 3 * 6 * 8
    assert r["floor"]["floor_us"] is None and "dry run" in r["floor"]["note"]
    doc = documented_schema(SCHEMA)
    for key in r:
        assert re.search(rf"^{key}\b|, {key}\b", doc, flags=re.M), f"{key} is not documented"
    for key in [*r["fused"], *r["correctness"]["fused"], *r["floor"], *r["floor"]["bytes"]]:
        assert key in doc, f"{key} is not documented"


def test_a_chain_that_does_not_fuse_fails_its_stage_with_the_reasons(tmp_path, monkeypatch):
    def scores_without_relu(self, q, w, keys, positions):
        visible = visible_entries(positions, keys.shape[-2], self.ratio)
        logits = torch.einsum("bthd,btnd->bthn", q[None].float(), keys[None].float())
        return torch.einsum("bth,bthn->btn", w[None], logits).masked_fill(~visible[None], NEG_INF)

    monkeypatch.setattr(bench_indexer.IndexerStep, "scores", scores_without_relu)
    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--out", str(out)]) == 1
    r = json.loads(out.read_text())
    assert not r["stages"]["fused"]["ok"] and "did not fuse once" in r["stages"]["fused"]["error"]
    assert r["fused"]["counts"] == {"mega_indexer": 0}
    assert [x["reason"] for x in r["fused"]["rejections"]] == ["the head weights do not multiply relu(logits)"]


def test_the_floor_counts_the_keys_once_q_w_and_the_top_k():
    # 2 rows, 3 entries of 68 bytes, 4 heads x 32 in bf16, top-5 int64
    assert floor_bytes(2, 3, 68, 4, 32, 2, 5) == {"index_keys": 408, "q": 512, "w": 32, "topk": 80, "total": 1032}
    cfg = preset("flash-lite")
    assert row_codec(cfg, "index_keys").row_bytes == 68  # 128 e2m1 nibbles + 4 ue8m0 scales
    assert plain_ratio(cfg) == 2  # layers 2, 8, 14
    # the defaults: 32 rows of 32768 tokens at ratio 2, 32 heads x 128, top-512
    got = floor_bytes(32, 16384, 68, 32, 128, 2, 512)
    assert got["index_keys"] == 35_651_584 and got["total"] == 35_651_584 + 262_144 + 4_096 + 131_072


def _brute_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    out = []
    for row in scores.tolist():
        order = sorted((n for n, s in enumerate(row) if s > NEG_INF), key=lambda n: (-row[n], n))[:k]
        out.append(sorted(order) + [-1] * (k - len(order)))
    return torch.tensor(out)


@pytest.mark.parametrize("seed", range(4))
def test_the_fp64_top_k_is_the_brute_force_one_with_exact_ties_and_invisible_entries(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (6, 40), generator=g).double()  # 7 values over 40 entries: many exact ties
    scores[1] = 0.0  # every entry ties: the lowest 5
    scores[2, 3:] = NEG_INF  # three visible entries of 5 wanted: -1 padded
    scores[3] = NEG_INF  # nothing visible
    scores[4] = torch.randn(40, generator=g, dtype=torch.float64)
    got = fp64_topk(scores, 5)
    assert torch.equal(got, _brute_topk(scores, 5))
    assert got[1].tolist() == [0, 1, 2, 3, 4] and got[2].tolist() == [0, 1, 2, -1, -1] and got[3].tolist() == [-1] * 5


def test_the_fp64_scores_are_the_sum_over_heads_of_relu_of_the_decoded_products():
    cfg = preset("tiny")
    codec = row_codec(cfg, "index_keys")
    q, w, pool, pages, positions = make_inputs(cfg, 2, 48, 2, 16, "cpu", seed=5)  # 24 entries, 3 pages a row
    positions = torch.tensor([47, 9])  # row 1 sees (9 + 1) // 2 = 5 entries
    scores = fp64_scores(q, w, pool, pages, positions, codec, 2)
    for r in range(2):
        keys = codec.decode(pool[pages[r]].reshape(-1, codec.row_bytes), torch.float64)
        for n in range(24):
            want = sum(w[r, h].item() * max(0.0, (q[r, h].double() @ keys[n]).item()) for h in range(cfg.index_heads))
            visible = n < (positions[r].item() + 1) // 2
            assert scores[r, n].item() == (pytest.approx(want, rel=1e-12) if visible else NEG_INF), (r, n)


def test_a_swap_at_the_k_th_score_is_a_tie_and_another_is_not():
    scores = torch.tensor([[5.0, 3.0, 3.0 + 1e-9, 1.0], [5.0, 3.0, 2.0, 1.0]], dtype=torch.float64)
    want = fp64_topk(scores, 2)  # [[0, 2], [0, 1]]
    got = torch.tensor([[0, 1], [0, 2]])  # row 0: its neighbour within 1e-9 / 3; row 1: a score 1/3 below
    c = compare_sets(got, want, scores)
    assert (c["differing_rows"], c["differing_not_ties"], c["ties_aside"]) == (2, 1, False)
    assert [d["tie"] for d in c["differing"]] == [True, False]
    assert c["differing"][1] == {"row": 1, "only_got": [2], "only_reference": [1], "max_rel_gap": pytest.approx(1 / 3),
                                 "tie": False}
    assert compare_sets(want, want, scores)["differing_rows"] == 0


@pytest.mark.parametrize("argv", [["--dry-run", "--ratio", "3"], ["--dry-run", "--batch", "0"],
                                  ["--dry-run", "--config", "no-such-preset"],
                                  ["--dry-run", "--select-configs", "1000x4"], ["--dry-run", "--select-configs", "1024x3"],
                                  ["--dry-run", "--select-configs", "1024"]])
def test_bad_arguments_are_usage_errors(argv, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", str(tmp_path / "r.json")])
    assert e.value.code == 2
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_selection_sweep_checks_each_launch_against_select_topk(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--select-configs", "256x4,1024x8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["select_configs"]
    assert [(r["block_select"], r["num_warps"], r["equal"]) for r in rows] == [(256, 4, True), (1024, 8, True)]
    assert not any("graph_us" in r for r in rows)  # untimed on the CPU
    # a selection that chooses otherwise is recorded as differing and fails the run; one that cannot
    # launch is its error
    wrong = iter([lambda scores, spec, config: torch.zeros(scores.shape[0], spec.topk, dtype=torch.int64),
                  lambda scores, spec, config: (_ for _ in ()).throw(RuntimeError("out of shared memory"))])
    monkeypatch.setattr(bench_indexer, "select", lambda *a: next(wrong)(*a))
    assert main(["--dry-run", "--select-configs", "256x4,512x4", "--out", str(out)]) == 1  # a wrong top-k fails
    rows = json.loads(out.read_text())["select_configs"]
    assert rows[0]["equal"] is False and "out of shared memory" in rows[1]["error"]
