"""A measured number in the docs is a claim that leads to the run behind it: `claims --check` holds
each converted page to its result files, and `--write` renders them afresh. The expected values
here are read from the result JSON directly, not through the registry's functions."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megafuse.tools import claims

REPO = Path(claims.__file__).resolve().parents[1]


@pytest.fixture
def copy(tmp_path):
    """The converted pages and the results, copied: a checkout the test may break."""
    for page in claims.CHECKED:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / page, tmp_path / page)
    shutil.copytree(REPO / "results", tmp_path / "results")
    return tmp_path


def run(capsys, *argv):
    status = claims.main(list(argv))
    return status, capsys.readouterr().out.splitlines()


def edit(root, page, old, new):
    """Replace `old` (once) in a page; return the 1-based line it was on."""
    text = (root / page).read_text()
    assert text.count(old) == 1, old
    (root / page).write_text(text.replace(old, new))
    return text[:text.index(old)].count("\n") + 1


def gate_json():
    return json.loads((REPO / "results/mega_gate/bench.json").read_text())


def test_every_converted_page_matches_its_results(capsys):
    status, out = run(capsys, "--check", "--root", str(REPO))
    assert out == [] and status == 0


def test_an_altered_claim_fails_naming_its_file_line_and_both_values(copy, capsys):
    rate = f"{gate_json()['rates']['tf32x3_tflops']:.1f} TFLOP/s"  # the figure the result gives
    line = edit(copy, "docs/mega_gate.md", f'[{rate}](../results/mega_gate/bench.json "claim: gate.tf32x3_rate")',
                '[90.0 TFLOP/s](../results/mega_gate/bench.json "claim: gate.tf32x3_rate")')
    status, out = run(capsys, "--check", "--root", str(copy))
    assert status == 1
    assert out == [f"docs/mega_gate.md:{line}: claim gate.tf32x3_rate: text says 90.0 TFLOP/s, result gives {rate}"]


def test_an_altered_cell_of_a_rendered_table_fails_at_its_line(copy, capsys):
    fused = gate_json()["results"][0]["fused_graph_us"]
    old = f"| 1 | {fused:.2f} us |"
    line = edit(copy, "docs/mega_gate.md", old, "| 1 | 7.00 us |")
    status, out = run(capsys, "--check", "--root", str(copy))
    assert status == 1 and len(out) == 1
    assert out[0].startswith(f"docs/mega_gate.md:{line}: claim gate.bench: text says | 1 | 7.00 us |")
    assert f"result gives {old}" in out[0]


def test_an_unclaimed_measured_number_in_prose_fails_with_its_line(copy, capsys):
    line = edit(copy, "docs/mega_mhc.md", "## Tried and dropped\n",
                "## Tried and dropped\n\nThe seam now takes 3.1 us at T = 1, 2.5x faster.\n")
    status, out = run(capsys, "--check", "--root", str(copy))
    assert status == 1
    assert [o.split(" (")[0] for o in out] == [f"docs/mega_mhc.md:{line + 2}: unclaimed measured number: 3.1 us",
                                               f"docs/mega_mhc.md:{line + 2}: unclaimed measured number: 2.5x"]


def test_numbers_in_code_settings_and_names_are_not_claims(copy, capsys):
    edit(copy, "docs/measuring.md", "## Checking a change on the GPU\n",
         "## Checking a change on the GPU\n\nRun `bench --limit 540 s` on an H100 80GB HBM3; it prints\n\n"
         "```\nfused 4.67 us, 13.0x\n```\n\n")
    assert run(capsys, "--check", "--root", str(copy)) == (0, [])


def test_write_restores_the_results_values_in_text_and_tables(copy, capsys):
    original = (copy / "docs/mega_gate.md").read_text()
    rate = f"{gate_json()['rates']['tf32x3_tflops']:.1f} TFLOP/s"
    fused = gate_json()["results"][0]["fused_graph_us"]
    edit(copy, "docs/mega_gate.md", f"[{rate}]", "[90.0 TFLOP/s]")
    edit(copy, "docs/mega_gate.md", f"| 1 | {fused:.2f} us |", "| 1 | 7.00 us |")
    status, out = run(capsys, "--write", "--root", str(copy))
    assert status == 0 and out == ["rewrote docs/mega_gate.md"]
    assert (copy / "docs/mega_gate.md").read_text() == original


def test_a_claim_linked_to_another_result_file_fails(copy, capsys):
    # the H200 rate is the same number in both files: only the link is wrong
    line = edit(copy, "docs/mega_gate.md", '(../results/mega_gate/bench.json "claim: gate.hbm_rate")',
                '(../results/mega_mhc/bench.json "claim: gate.hbm_rate")')
    status, out = run(capsys, "--check", "--root", str(copy))
    assert status == 1
    assert out == [f"docs/mega_gate.md:{line}: claim gate.hbm_rate: links to ../results/mega_mhc/bench.json, "
                   f"the claim's result is results/mega_gate/bench.json"]
    assert run(capsys, "--write", "--root", str(copy)) == (0, ["rewrote docs/mega_gate.md"])  # the link mended


def test_an_unknown_claim_name_fails_and_write_leaves_it(copy, capsys):
    line = edit(copy, "docs/measuring.md", "## Checking a change on the GPU\n",
                '## Checking a change on the GPU\n\nOn the H200 [5 us](../results/compiled/bench.json "claim: no.such")\n')
    for mode in ("--check", "--write"):
        status, out = run(capsys, mode, "--root", str(copy))
        assert status == 1
        assert out[-1] == f"docs/measuring.md:{line + 2}: unknown claim no.such (not in tools/claims.py's CLAIMS)"


def test_an_h100_figure_in_a_section_that_does_not_say_h100_fails(copy, capsys):
    with open(copy / "docs/measuring.md", "a") as f:
        f.write('\n## Elsewhere\n\nThe decode step takes [38.6 ms](../results/decode/flash-lite-8e.json '
                '"claim: decode8e.graphs_step").\n')
    line = (copy / "docs/measuring.md").read_text().count("\n")
    status, out = run(capsys, "--check", "--root", str(copy), "docs/measuring.md")
    assert status == 1
    assert out == [f"docs/measuring.md:{line}: claim decode8e.graphs_step: its result ran on H100; "
                   f"its section does not say H100"]


def test_the_list_gives_each_claim_its_value_device_date_and_command(capsys):
    status, out = run(capsys, "--list")
    assert status == 0
    step = json.loads((REPO / "results/decode/flash-lite-8e.json").read_text())["passes-32"]
    i = out.index(f"decode8e.graphs_step = {step['graphs_step_s'] * 1e3:.1f} ms")
    assert out[i + 1].startswith("    H100 80GB HBM3, 2026-12-06, results/decode/flash-lite-8e.json: "
                                 "python3 -m megafuse.tools.bench_decode --config")
    names = [line.split(" = ")[0] for line in out if not line.startswith(" ")]
    assert names == [*claims.CLAIMS, *claims.TABLES]
    assert not [line for line in out if "cannot be computed" in line or "not in RESULTS" in line]


def test_the_tool_runs_without_torch():
    code = "import sys; from megafuse.tools import claims; sys.exit(claims.main(['--check']) + 2 * ('torch' in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
