"""The split variant's persistent state, per device: the int32 sync buffer, the fp32 accumulator
of partial sums (both all zero between launches: the kernel restores that itself) and MONOTONIC
launches' int64 token-tile counters (which only grow). Allocated on a device's first split launch;
reserve it before capturing a CUDA graph (allocating during a capture raises)."""

from __future__ import annotations

import threading

import torch

from ..launch import device_key
from .spec import MhcSpec
from .tuning import CUDA_TABLE, choose_config, plan

SYNC_PER_TILE = 4  # arrive A, ready A, arrive C, ready C


class DeviceState:
    """The split variant's persistent buffers on one device: the int32 sync buffer and the fp32
    accumulator of partial sums, all zero between launches (the kernel restores that itself), and
    MONOTONIC launches' int64 token-tile counters, per (n_splits, r_splits): [tiles, 2] that only
    grow, each tile's by the same amounts every launch (see the kernel). Buffers only grow; an
    outgrown buffer is kept alive (`retired`): a captured graph may point at it."""

    def __init__(self):
        self.sync = None
        self.acc = None
        self.tiles: dict[tuple[int, int], torch.Tensor] = {}
        self.retired = []


states: dict[str, DeviceState] = {}
_state_lock = threading.Lock()


def _grown(st: DeviceState, buf: torch.Tensor | None, name: str, need: int, minimum: int, dtype,
           device) -> torch.Tensor:
    """`buf`, or a zeroed buffer of at least `need` elements where it is smaller (or None)."""
    if buf is None or buf.numel() < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mega_mhc needs to allocate its persistent {name} buffer during CUDA graph capture; "
                "run mega_mhc once eagerly at the largest token count (or call reserve_sync) first")
        if buf is not None:
            st.retired.append(buf)
        buf = torch.zeros(max(need, minimum), dtype=dtype, device=device)
    return buf


def _grow(st: DeviceState, name: str, need: int, minimum: int, dtype, device) -> torch.Tensor:
    setattr(st, name, _grown(st, getattr(st, name), name, need, minimum, dtype, device))
    return getattr(st, name)


def counters_consistent(counters: torch.Tensor, n_splits: int, r_splits: int) -> bool:
    """Whether every token tile's counters are whole launches: arrivals / n_splits equal to rescale
    tickets / r_splits (what every completed launch leaves)."""
    arrive, rescale = counters.view(-1, 2).unbind(1)
    return bool((arrive * r_splits == rescale * n_splits).all())


def tile_counters(device: torch.device, n_splits: int, r_splits: int, n_tiles: int) -> torch.Tensor:
    """A MONOTONIC launch's int64 token-tile counters (DeviceState.tiles)."""
    with _state_lock:
        st = states.setdefault(device_key(device), DeviceState())
        key = (n_splits, r_splits)
        st.tiles[key] = _grown(st, st.tiles.get(key), "token-tile counter", 2 * n_tiles, 2 * 1024, torch.int64,
                               device)
        return st.tiles[key]


def split_buffers(device: torch.device, n_tiles: int, acc_elems: int):
    """(sync, accumulator) for a split launch with n_tiles token tiles."""
    with _state_lock:
        st = states.setdefault(device_key(device), DeviceState())
        sync = _grow(st, "sync", 2 + SYNC_PER_TILE * max(n_tiles, 1), 2 + SYNC_PER_TILE * 1024, torch.int32, device)
        acc = _grow(st, "acc", acc_elems, 1 << 16, torch.float32, device)
        return sync, acc


def reserve_sync(spec: MhcSpec, max_tokens: int, device: torch.device | str = "cuda") -> None:
    """Allocate the persistent buffers launches of up to `max_tokens` need (call before capturing
    a CUDA graph, or run one eager launch at the largest token count)."""
    device = torch.device(device)
    # the most token tiles any launch up to max_tokens has: at the top of each band of the table
    # (a band of shorter tiles may have more tiles than the next band's first sizes)
    sizes = [max_tokens] + [t for t, _ in CUDA_TABLE if t is not None and t < max_tokens]
    plans = [plan(spec, choose_config(spec, t, device=device, variant="split"), t) for t in sizes]
    split_buffers(device, max(p["n_tiles"] for p in plans), max(p["acc_elems"] for p in plans))
    for p in plans:  # (whether a launch runs MONOTONIC is known only at launch: reserved alike)
        if p["r_splits"] and spec.pre == "carried":
            tile_counters(device, p["n_splits"], p["r_splits"], p["n_tiles"])


def sync_state_is_clear(device: torch.device | str = "cuda") -> bool:
    """Whether the device's persistent state is as every completed launch leaves it: the sync words
    and the accumulator zero, each token-tile counter a whole number of launches (synchronise
    first: a launch in flight has them in use)."""
    st = states.get(device_key(torch.device(device)))
    if st is None:
        return True
    zero = all(buf is None or not bool(buf.any()) for buf in (st.sync, st.acc))
    return zero and all(counters_consistent(counters, *key) for key, counters in st.tiles.items())


def reset_sync(device: torch.device | str = "cuda") -> None:
    """Zero the persistent state again (only needed after a launch was aborted mid-way)."""
    st = states.get(device_key(torch.device(device)))
    if st is not None:
        for buf in (st.sync, st.acc, *st.tiles.values()):
            if buf is not None:
                buf.zero_()
