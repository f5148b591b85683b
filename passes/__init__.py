"""The compiler: a pass manager for Inductor, the pass registry and one file per fusion pass.

    from megafuse import passes
    fused = passes.compile(model, passes="all")     # or "none", or ["mega_gate"]
    logits = fused(ids)
    print(fused.report.counts())                    # {"mega_gate": 12}
"""

from .api import FusedModule, block_compiler, compile
from .manager import PassManager
from . import ops  # noqa: F401  (registers the megafuse:: ops and their lowerings)
from .registry import available, descriptions

__all__ = ["FusedModule", "PassManager", "available", "block_compiler", "compile", "descriptions"]
