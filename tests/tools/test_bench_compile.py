"""`bench_compile` (dry run, CPU): each phase a new process on one cache folder; the second
`blocks` phase is served by the first's caches, with the same counts and logits."""

import json

import pytest

from megafuse.model import preset
from megafuse.tools import bench_compile


@pytest.mark.slow  # two processes, each compiling (then loading) 3 graphs of a 2-layer tiny
def test_a_second_process_compiles_nothing_and_reports_it(tmp_path):
    # 2 layers: a SWA-only first layer and the decoder's KV source, two kinds, and the head
    cfg = preset("tiny").replace(n_layers=2, compress_ratios=(0, 1), kv_source_layers=(1,), index_source_layers=(1,),
                                 engram_layers=())
    config, out = tmp_path / "tiny2.json", tmp_path / "compile.json"
    config.write_text(json.dumps(cfg.to_dict()))
    argv = ["--config", str(config), "--batches", "2", "--context", "24", "--dry-run", "--phases", "blocks,blocks",
            "--cache-dir", str(tmp_path / "inductor"), "--out", str(out)]
    assert bench_compile.main(argv) == 0
    r = json.loads(out.read_text())
    cold, warm = r["runs"]
    assert cold["ok"] and warm["ok"]
    assert (cold["graphs"], cold["graphs_from_cache"]) == (3, 0)
    assert (warm["graphs"], warm["graphs_from_cache"]) == (3, 3)
    assert cold["counts"] == warm["counts"] == {"mega_mhc": 2 * 2 + 1, "mega_gate": 2, "mega_attention": 2, "mega_moe": 2,
                                                     "mega_indexer": 1}
    assert cold["repeat_max_abs"] == 0.0  # a cleared cache makes the second call a true repeat
    assert r["summary"]["warm_graphs_from_cache"] == "3 of 3"
    assert r["summary"]["cold_compile_s"] == cold["compile_s"] and r["summary"]["warm_compile_s"] == warm["compile_s"]


def test_an_unknown_phase_is_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_compile.main(["--phases", "blocks,fast", "--dry-run"])
    assert exit_info.value.code == 2
    assert "--phases takes blocks or regions" in capsys.readouterr().err
