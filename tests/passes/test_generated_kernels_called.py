"""Inductor's compiled code calls the generated kernels: once per match the report counts, and
never the reference op a match was rewritten into.

One module holds each fused chain the passes know (an mHC seam, two gates, an attention, an MoE
block's routed experts and an indexer's step, written with the model's own functions), compiled by Inductor with every pass; its output code is read
directly (torch._inductor.utils.run_and_get_code), and a profiled call counts the kernel ops run.
"""

import collections
import importlib
import re

import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from megafuse import passes
from tests.passes.attention_clients import AttentionChain
from tests.passes.gate_clients import GateChain
from tests.passes.test_mega_attention import _inputs as attention_inputs
from tests.passes.test_mega_indexer import CFG as INDEXER_CFGS
from tests.passes.test_mega_indexer import IndexerStep
from tests.passes.test_mega_indexer import _inputs as indexer_inputs
from tests.passes.test_mega_mhc import Seam
from tests.passes.test_mega_mhc import _inputs as seam_inputs
from tests.passes.test_mega_moe import _moe

# an op call in Inductor's Python wrapper: `buf6 = torch.ops.megafuse.mega_gate_kernel.default(arg9_1, ...)`
OP_CALL = re.compile(r"torch\.ops\.megafuse\.(\w+)\.default\(")


class EveryChain(nn.Module):
    """A seam, two gates of one input (so one kernel is called twice), an attention, an MoE block
    (whose own router is a third gate) and an indexer's step."""

    def __init__(self):
        super().__init__()
        self.seam = Seam("delayed")
        self.gates = nn.ModuleList([GateChain(k=2), GateChain(k=3)])
        self.attention = AttentionChain()
        self.moe = _moe(torch.float32, "none")[1]
        self.indexer = IndexerStep(INDEXER_CFGS["ref"])

    def forward(self, seam_args, u, attention_args, tokens, indexer_args):
        return (self.seam(*seam_args), [gate(u) for gate in self.gates], self.attention(*attention_args),
                self.moe(tokens), self.indexer(*indexer_args))


def _generated_kernel(name: str) -> str:
    """The kernel the lowering of pass `name` generates: `KERNEL_NAME` of lowering/<op>."""
    op = passes.registry.get(name).op.split("::")[-1]
    return importlib.import_module(f"megafuse.lowering.{op}").KERNEL_NAME


def test_compiled_code_calls_each_generated_kernel_once_per_match():
    module = EveryChain().eval()
    args = (seam_inputs(5, torch.float32), torch.randn(5, 64, generator=torch.Generator().manual_seed(0)),
            attention_inputs(2, 3, torch.float32, seed=1),
            torch.randn(5, module.moe.experts.w13.shape[-1], generator=torch.Generator().manual_seed(2)),
            indexer_inputs(INDEXER_CFGS["ref"]))
    torch._dynamo.reset()
    # the FX graph cache off: a graph served from it has no output code to read
    fused = passes.compile(module, passes="all", fullgraph=True, options={"fx_graph_cache": False})
    _, [code] = run_and_get_code(fused, *args)
    counts = fused.report.counts()
    assert counts == {"mega_mhc": 1, "mega_gate": 3, "mega_attention": 1, "mega_moe": 1, "mega_indexer": 1}, \
        {name: fused.report.rejections(name) for name in passes.available()}
    kernels = {name: _generated_kernel(name) for name in counts}

    # 1. the output code: each generated kernel's op once per match, and no other megafuse op (a
    #    canonical op left in the code would run the torch reference instead of the kernel)
    called = collections.Counter(OP_CALL.findall(code))
    assert called == {kernels[name]: n for name, n in counts.items() if n}, called

    # 2. a call runs them: the kernel ops' launches in one profiled forward
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fused(*args)
    launched = collections.Counter(e.name for e in prof.events() if e.name.startswith("megafuse::"))
    assert launched == {f"megafuse::{kernels[name]}": n for name, n in counts.items() if n}, launched
