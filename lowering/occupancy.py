"""How many programs (CUDA blocks) of a compiled kernel one SM holds at once: the CUDA occupancy
calculation from registers, shared memory and warps. `lowering.offline` asks it for sm_90 builds
made on a CPU machine; Mega-mHC's launcher asks it for the GPU it runs on, to know whether a grid
fits on the device at once (a cooperative launch: see `mega_mhc.Dispatch.RESIDENT`).
"""

from __future__ import annotations

import torch

# per-SM limits (CUDA occupancy calculator): registers, shared memory (plus what the runtime
# reserves per block), resident warps and blocks; registers are allocated per warp in units of 256
HOPPER_SM = dict(registers=65536, shared_bytes=228 * 1024, reserved_smem_per_block=1024, warps=64, blocks=32,
                 register_unit=256)
# The limits torch's device properties do not give (registers, resident blocks, allocation units),
# for the architectures they are known for here; shared memory and warps come from the device.
_ARCH_LIMITS = {(8, 0): dict(registers=65536, reserved_smem_per_block=1024, blocks=32, register_unit=256),
                (9, 0): dict(registers=65536, reserved_smem_per_block=1024, blocks=32, register_unit=256)}


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int, sm: dict = HOPPER_SM) -> int:
    """Programs of `num_warps` warps, `registers` per thread and `shared_bytes` each that one SM
    holds at once: the tightest of its register, shared-memory, warp and block limits."""
    unit = sm["register_unit"]
    per_warp = -(-registers * 32 // unit) * unit
    return min(sm["registers"] // (per_warp * num_warps),
               sm["shared_bytes"] // (shared_bytes + sm["reserved_smem_per_block"]),
               sm["warps"] // num_warps, sm["blocks"])


def device_sm(device: torch.device) -> dict | None:
    """The per-SM limits of a CUDA device, or None for an architecture not in _ARCH_LIMITS."""
    props = torch.cuda.get_device_properties(device)
    arch = _ARCH_LIMITS.get((props.major, props.minor))
    if arch is None:
        return None
    return dict(arch, shared_bytes=props.shared_memory_per_multiprocessor,
                warps=props.max_threads_per_multi_processor // props.warp_size)


def resident_programs(registers: int, shared_bytes: int, num_warps: int, device: torch.device) -> int:
    """How many programs of such a kernel the whole device holds at once. On an architecture whose
    limits are not known here, one per SM (a kernel that launches at all fits that)."""
    sm = device_sm(device)
    per_sm = programs_per_sm(registers, shared_bytes, num_warps, sm) if sm else 1
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
