"""passes.compile: selections and options that would silently do nothing are errors naming the valid
choices; it compiles for inference whatever the caller's grad mode; it logs its progress under
megafuse.*."""

import logging
import re
import warnings

import pytest
import torch
from torch import nn

from megafuse import passes
from tests.passes.gate_clients import GateChain


@pytest.mark.parametrize("selection", ["", " , "])  # (an empty list, built by a program, is "none")
def test_an_empty_pass_selection_is_an_error_naming_the_choices(selection):
    with pytest.raises(ValueError, match=r"no pass selected .*valid: 'all', 'none' \(plain Inductor\) or names among "
                                         r"mega_mhc, mega_gate, mega_attention, mega_moe, mega_indexer"):
        passes.compile(nn.Linear(4, 4), passes=selection)


def test_an_option_value_a_pass_does_not_take_is_an_error_naming_the_valid_values():
    with pytest.raises(ValueError, match=r"pass 'mega_gate': precision='fast' is not a valid value; valid: "
                                         r"'ieee', 'tf32x3', 'tf32'"):
        passes.compile(nn.Linear(4, 4), pass_options={"mega_gate": {"precision": "fast"}})
    passes.compile(nn.Linear(4, 4), pass_options={"mega_gate": {"precision": "ieee"}})  # a valid one


def test_a_module_compiled_with_autograd_on_still_fuses_and_runs_for_inference():
    # grad mode as a user leaves it (on; the suite's tests run under no_grad): AOT autograd would
    # otherwise keep the chain's intermediates for a backward, and "is also used outside the gate
    # chain" would stop the fusion
    chain = GateChain().eval()
    u = torch.randn(5, 64, requires_grad=True)
    torch._dynamo.reset()
    with torch.enable_grad():
        fused = passes.compile(chain, passes=["mega_gate"], fullgraph=True)
        weights, ids = fused(u)
        assert not weights.requires_grad and torch.is_grad_enabled()
        want_weights, want_ids = chain(u)
    assert fused.report.counts() == {"mega_gate": 1}, fused.report.rejections("mega_gate")
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_a_compile_logs_each_graph_and_what_the_passes_did_under_megafuse(caplog):
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="megafuse"):
        fused = passes.compile(GateChain(), passes=["mega_gate"], fullgraph=True, options={"fx_graph_cache": False})
        fused(torch.randn(5, 64))
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("megafuse.")]
    # each graph is named by its index, the function Dynamo traced and its compile id, which tell
    # apart the graph 0 of two compiles
    label = r"graph 0 \(GateChain\.forward, frame \d+/0\)"
    assert re.fullmatch(label + r": \d+ FX nodes from Dynamo; AOT autograd, the passes and Inductor's codegen next",
                        messages[0]), messages
    assert re.fullmatch(label + r": mega_gate: 1 matched, 0 rejected in \d+\.\d\d s", messages[1]), messages
    assert re.fullmatch(label + r": compiled in \d+\.\d s \(the passes ran\)", messages[2]), messages


def test_print_of_a_report_is_its_table():
    fused = passes.compile(GateChain(), passes=["mega_gate"], fullgraph=True)
    fused(torch.randn(5, 64))
    printed = str(fused.report).splitlines()
    assert printed[0].strip() == "megafuse passes"
    row = next(line for line in printed if "mega_gate" in line)
    assert row.split("│")[1:4] == [" mega_gate ", " 1       ", " 0        "]


def test_a_module_in_training_mode_compiles_with_one_warning_that_its_outputs_carry_no_grad():
    def compile_twice(module):
        u = torch.randn(5, 64, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught, torch.enable_grad():
            warnings.simplefilter("always")  # every warning recorded: the once is megafuse's own
            outputs = [passes.compile(module, passes="none", fullgraph=True)(u) for _ in range(2)]
        for (weights, ids), (want_weights, want_ids) in zip(outputs, [module(u)] * 2):  # compiled all the same
            assert not weights.requires_grad and torch.equal(ids, want_ids)
            assert torch.allclose(weights, want_weights.detach(), rtol=1e-5, atol=1e-6)
        return [w for w in caught if "training mode" in str(w.message)]

    torch._dynamo.reset()
    training = compile_twice(GateChain())  # nn.Module's default mode
    assert len(training) == 1 and training[0].category is UserWarning and training[0].filename == __file__
    assert str(training[0].message) == (
        "passes.compile: GateChain is in training mode, and megafuse compiles for inference: the outputs carry no "
        "grad (the compiled module runs under torch.no_grad()). Call model.eval() before compiling; use "
        "torch.compile to train.")
    assert compile_twice(GateChain().eval()) == []
