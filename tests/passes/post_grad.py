"""Run megafuse's passes on Inductor's real post-grad graph and execute that graph, without code
generation: the spelling tests compile hundreds of small chains, and Inductor's C++ code
generation (seconds a graph on the CPU) is what a match does not depend on.

`fuse(module, args, passes)` traces `module` with Dynamo and AOT autograd exactly as
`passes.compile` does (Inductor's decompositions, its pre-grad and joint-graph passes), runs
Inductor's post-grad passes with the PassManager installed (`view_to_reshape`, fake-tensor
propagation, then `_recursive_post_grad_passes`, the steps `compile_fx_inner` takes before code
generation), and returns a callable that runs the rewritten FX graph op by op. The canonical
`megafuse::` ops in it are swapped for their kernel ops, so a call runs the generated kernels (the
Triton interpreter on the CPU), as a compiled graph would.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import _recursive_post_grad_passes, compile_fx, fake_tensor_prop
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.output_code import OutputCode
from torch._inductor.virtualized import V

from megafuse.passes import FusedModule, PassManager, registry

# every pass's canonical op -> its kernel op (`passes.ops` registers `<op>_kernel` beside each)
_OPS = [registry.get(name).op.split("::")[-1] for name in registry.available()]
KERNEL_OPS = {getattr(torch.ops.megafuse, op).default: getattr(torch.ops.megafuse, f"{op}_kernel").default for op in _OPS}


@dataclasses.dataclass
class _GraphOutput(OutputCode):
    """Inductor's compiled-graph interface over an FX graph that runs eagerly (boxed inputs)."""

    gm: fx.GraphModule = None
    _boxed_call = True  # AOT autograd's runtime hands over its argument list

    def __call__(self, inputs):
        return self.gm(*inputs)

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        pass

    def prepare_for_serialization(self) -> None:
        pass

    def set_triton_bundle(self, triton_bundle) -> None:
        pass


def _post_grad_only(manager: PassManager, graphs: list):
    def inner_compile(gm: fx.GraphModule, example_inputs, **kwargs) -> OutputCode:
        view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = fake_tensor_prop(gm, example_inputs)
        with V.set_fake_mode(fake_mode), inductor_config.patch(post_grad_custom_post_pass=manager):
            _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", True))
        graphs.append(str(gm.graph))
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in KERNEL_OPS:
                node.target = KERNEL_OPS[node.target]
        gm.recompile()
        return _GraphOutput(gm=gm)
    return inner_compile


def fuse(module: torch.nn.Module, passes="all", *, pass_options: dict | None = None, **compile_kwargs):
    """`module` under the passes, run from its post-grad graph: a FusedModule (report included)
    whose `post_grad_graphs` are the rewritten graphs as text."""
    manager = PassManager(passes, options=pass_options)
    graphs: list[str] = []
    inner = _post_grad_only(manager, graphs)

    def backend(gm, example_inputs):
        with inductor_config.patch(fx_graph_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    torch._dynamo.reset()
    fused = FusedModule(module, manager, torch.compile(module, backend=backend, **compile_kwargs))
    fused.post_grad_graphs = graphs
    return fused
