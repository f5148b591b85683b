"""Kernel generation: FusionSpec -> Triton source, a kernel cache on disk, launch code, references.

    kernel_cache   where generated sources live (~/.cache/megafuse/kernels, $MEGAFUSE_KERNEL_CACHE,
                   set_cache_dir), atomic writes, and loading one module per Triton mode
                   (interpreter for CPU tensors, compiler for CUDA tensors)
    mega_gate      GateSpec -> the Mega-Gate kernel (gate GEMM + scoring + bias + top-k + gather +
                   renormalise + scale in one launch), its launcher and its torch reference
    mega_mhc       (a package) MhcSpec -> the Mega-mHC kernel (post + coefficients + Sinkhorn + pre +
                   RMSNorm in one launch), its launch configurations, launcher and torch reference
    mega_indexer   IndexerSpec -> the Mega-Indexer kernels (index keys decoded from the cache bytes,
                   scores, the top-k by a radix search: no sort), its launcher and reference
    launch         what both launchers share: kept launches per input layout, fast output
                   allocation, the per-device key of persistent state
    offline        build a launcher's kernel for a GPU that is not here (sm_90 by default): PTX,
                   cubin, registers, spills, shared memory, from CPU tensors
    occupancy      how many programs of a compiled kernel an SM, or a whole device, holds at once

Every generator here follows the same shape: a frozen spec with `key()` and `describe()`,
`unsupported_reason(spec)` for the pass report, `generate_source(spec)` from a template, a
launcher that validates its inputs against the spec, and `reference(...)` that calls the model's
own maths. `lowering/` knows kernels, not graphs.
"""
