"""The pass manager and the public API: cache key, registry, errors, dynamic shapes, no global state."""

import pytest
import torch
import torch._inductor.config as inductor_config

from megafuse import passes
from megafuse.passes.manager import PassManager
from megafuse.passes.mega_gate import MegaGatePass
from tests.passes.gate_clients import GateChain


def test_uuid_depends_on_enabled_passes_options_and_source(monkeypatch):
    base = PassManager("all").uuid()
    assert PassManager("all").uuid() == base  # stable
    assert PassManager("none").uuid() != base
    assert PassManager("all", options={"mega_gate": {"precision": "ieee"}}).uuid() != base
    monkeypatch.setattr(MegaGatePass, "source", lambda self: "changed source")
    assert PassManager("all").uuid() != base


def test_uuid_covers_every_module_that_decides_a_fusion(tmp_path, monkeypatch):
    # the graph readers and the lowering's support checks decide what fuses, so an edit to any of
    # them, or a module added to a package below them, must change the key Inductor's cache
    # serves graphs by
    import shutil
    from megafuse.passes import manager as manager
    for folder in ("passes", "lowering"):
        shutil.copytree(manager._ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    base = PassManager("all").uuid()
    monkeypatch.setattr(manager, "_ROOT", tmp_path)
    assert PassManager("all").uuid() == base  # the same code elsewhere: the same key
    for module in ("passes/graph.py", "passes/base.py", "lowering/mega_gate.py", "lowering/mega_mhc/tuning.py"):
        path = tmp_path / module
        original = path.read_text()
        path.write_text(original + "\n# an edit\n")
        assert PassManager("all").uuid() != base, module
        path.write_text(original)
    (tmp_path / "lowering" / "a_package").mkdir()
    (tmp_path / "lowering" / "a_package" / "support.py").write_text("SUPPORTED = ()\n")
    assert PassManager("all").uuid() != base


def test_a_graph_served_from_inductors_cache_brings_its_report(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    reports = []
    for _ in range(2):
        torch._dynamo.reset()
        fused = passes.compile(GateChain(), passes="all", fullgraph=True)
        w, ids = fused(torch.randn(5, 64))
        reports.append(fused.report)
    first, second = reports
    assert [g.cached for g in first.graphs] == [False] and [g.cached for g in second.graphs] == [True]
    assert second.counts() == first.counts() == {"mega_mhc": 0, "mega_gate": 1, "mega_attention": 0, "mega_moe": 0,
                                                   "mega_indexer": 0}
    assert second.to_dict()["per_pass"] == first.to_dict()["per_pass"]
    # a graph served without a stored report (lost, or stored under another Dynamo graph that lowers
    # the same) is compiled again with the caches off: its report is the first compile's, not "nothing"
    for stored in (tmp_path / "megafuse_reports").iterdir():
        stored.unlink()
    torch._dynamo.reset()
    fused = passes.compile(GateChain(), passes="all", fullgraph=True)
    fused(torch.randn(5, 64))
    assert [g.cached for g in fused.report.graphs] == [False] and fused.report.unreported == 0
    assert fused.report.counts() == first.counts()
    assert [m.spec for m in fused.report.matches("mega_gate")] == [m.spec for m in first.matches("mega_gate")]
    assert len(list((tmp_path / "megafuse_reports").iterdir())) == 1  # and stored again


def test_registry_lists_passes_with_descriptions():
    assert passes.available() == ["mega_mhc", "mega_gate", "mega_attention", "mega_moe",
                                   "mega_indexer"]  # the order the manager runs them
    assert "top-k" in passes.descriptions()["mega_gate"]
    assert "Sinkhorn" in passes.descriptions()["mega_mhc"]


@pytest.mark.parametrize("selection, words", [
    (["mega_gat"], "valid passes: mega_mhc, mega_gate, mega_attention, mega_moe, mega_indexer"),
    ("nope,mega_gate", "valid passes: mega_mhc, mega_gate, mega_attention, mega_moe, mega_indexer"),
])
def test_unknown_pass_names_list_the_valid_ones(selection, words):
    with pytest.raises(ValueError, match=words):
        passes.compile(GateChain(), passes=selection)


def test_bad_options_and_backends_are_errors():
    with pytest.raises(ValueError, match="unknown options"):
        PassManager("all", options={"mega_gate": {"precison": "ieee"}})
    with pytest.raises(ValueError, match="backend must be 'inductor'"):
        passes.compile(GateChain(), backend="eager")


def test_no_global_state_left_behind():
    torch._dynamo.reset()
    fused = passes.compile(GateChain(), passes="all", fullgraph=True)
    fused(torch.randn(5, 64))
    assert fused.report.counts() == {"mega_mhc": 0, "mega_gate": 1, "mega_attention": 0, "mega_moe": 0,
                                                   "mega_indexer": 0}
    assert inductor_config.post_grad_custom_post_pass is None
    # a plain torch.compile afterwards sees no megafuse pass
    torch._dynamo.reset()
    plain = torch.compile(GateChain(), fullgraph=True)
    plain(torch.randn(5, 64))


def test_dynamic_token_dimension_compiles_once(tmp_path):
    torch._dynamo.reset()
    module = GateChain()
    fused = passes.compile(module, passes=["mega_gate"], dynamic=True, fullgraph=True)
    for n_tokens in (3, 8, 21, 40):
        u = torch.randn(n_tokens, 64)
        w, ids = fused(u)
        w_ref, ids_ref = module(u)
        assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)
    assert len(fused.report.graphs) == 1  # one compile serves every length
    assert fused.report.counts() == {"mega_gate": 1}


def test_dumps_before_and_after(tmp_path):
    torch._dynamo.reset()
    passes.compile(GateChain(), passes=["mega_gate"], dump_dir=tmp_path)(torch.randn(4, 64))
    before = (tmp_path / "graph000_mega_gate_before.txt").read_text()
    after = (tmp_path / "graph000_mega_gate_after.txt").read_text()
    assert "aten.topk" in before and "aten.topk" not in after and "megafuse.mega_gate" in after
