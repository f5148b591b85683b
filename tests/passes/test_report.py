"""The report groups rejections by reason, with a count, so one cause at many sites reads as one row."""

from megafuse.passes.report import CompileReport, GraphReport, PassReport, Rejection


def test_rejections_group_by_reason_with_node_names_read_as_one_and_counts():
    reasons = ["intermediate mm_6 is also used outside the gate chain",
               "intermediate mm_105 is also used outside the gate chain",
               "intermediate sum_1024 is also used outside the gate chain",
               "the top-k input is not a gate score (found where.self)",
               "sqrt of something that is not softplus: not a supported scoring function"]
    report = CompileReport(["mega_gate"])
    report.graphs.append(GraphReport([PassReport("mega_gate", rejections=[
        Rejection(f"topk_{i}", reason) for i, reason in enumerate(reasons)])]))
    assert report.rejection_reasons("mega_gate") == [
        ("intermediate <node> is also used outside the gate chain", 3),
        ("sqrt of something that is not softplus: not a supported scoring function", 1),
        ("the top-k input is not a gate score (found where.self)", 1)]
    assert len(report.rejections("mega_gate")) == 5  # each site, with its node, stays in the report
    cells = [cell for column in report.table().columns for cell in column._cells]
    assert "intermediate <node> is also used outside the gate chain (x3)" in cells[-1].split("\n")
