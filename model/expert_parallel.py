"""Expert parallelism (EP): each rank holds a contiguous shard of the routed experts; a MoE layer's
(token, expert) slots travel to the rank holding their expert and their outputs come back, by
all-to-all over torch.distributed (gloo on CPUs, NCCL on GPUs).

    rank r holds experts expert_range(E, r, world)             contiguous; the first E mod world ranks one more
    send:    each local slot (token row, local expert id, route weight) to its expert's rank
    compute: the shard's experts on the slots it received (Experts.slot_outputs, fp32)
    return:  the fp32 slot outputs to the slots' home ranks, summed over each token's k experts there

The router (the fused Mega-Gate where the passes run) and the shared expert stay local: every rank
routes its own tokens. A slot's output depends on its own token, expert and weight only, and the
home rank sums a token's k outputs in the same order as one process does, so on the CPU the sharded
layer equals the whole one bit for bit. Every rank must run each MoE layer together (a collective),
with any number of tokens of its own, none included.

Under torch.compile the exchange is one opaque op, `megafuse::expert_exchange`: the all-to-all's
sizes come from the routing, so Dynamo traces it (fullgraph) as a call that returns a tensor shaped
like its input, and the router before it stays in the graph for the passes (Mega-Gate) to fuse.
The op finds its shard by name. It waits on the host for the counts, so a graph holding it cannot
be captured as a CUDA graph.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist
from torch import nn

from .moe import MoE, sum_slots


def expert_range(n_experts: int, rank: int, world: int) -> range:
    """The contiguous experts rank `rank` of `world` holds; together the ranks hold each expert once."""
    if not 1 <= world <= n_experts:
        raise ValueError(f"expert parallelism over {world} ranks needs 1 <= world size <= the {n_experts} routed "
                         "experts (every rank holds at least one)")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the world of {world} ranks (0..{world - 1})")
    base, extra = divmod(n_experts, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


_SHARDS: "weakref.WeakValueDictionary[str, ShardedExperts]" = weakref.WeakValueDictionary()
_NAMES = itertools.count()


@torch.library.custom_op("megafuse::expert_exchange", mutates_args=())
def expert_exchange(u: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, shard: str) -> torch.Tensor:
    """The routed experts' output [N, D] of the tokens u [N, D] with their top-k weights and ids,
    computed by the ranks holding the experts (ShardedExperts `shard`)."""
    return _SHARDS[shard].exchange(u, weights, idx)


@expert_exchange.register_fake
def _(u, weights, idx, shard):
    return torch.empty_like(u)


class ShardedExperts(nn.Module):
    """A drop-in for `moe.Experts` on one rank: forward(u, weights, idx) over the rank's own tokens,
    the slots computed wherever their experts live (module doc)."""

    def __init__(self, experts, rank: int, world: int, group=None):
        super().__init__()
        n_experts = experts.w13.shape[0]
        self.world, self.group = world, group
        self.held = expert_range(n_experts, rank, world)
        self.shard = experts.shard(self.held)
        # the first expert id of every rank's shard, for the owner of each slot
        self.register_buffer("starts", torch.tensor([expert_range(n_experts, r, world).start for r in range(world)]),
                             persistent=False)
        self.name = f"shard{next(_NAMES)}"  # how the compiled graph's op finds this module
        _SHARDS[self.name] = self

    def _exchange(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=self.group)
        return out

    def forward(self, u: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return expert_exchange(u, weights, idx, self.name)

    def exchange(self, u: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        k = idx.shape[1]
        slot_expert = idx.flatten()
        owner = torch.searchsorted(self.starts, slot_expert, right=True) - 1
        order = torch.argsort(owner, stable=True)  # slots grouped by the rank that computes them
        send_counts = torch.bincount(owner, minlength=self.world)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=self.group)
        send, receive = send_counts.tolist(), receive_counts.tolist()
        tokens = self._exchange(u[order // k], send, receive)
        experts = self._exchange((slot_expert - self.starts[owner])[order], send, receive)  # ids within the owner's shard
        slot_weight = self._exchange(weights.flatten()[order], send, receive)
        computed = self.shard.slot_outputs(tokens, slot_weight, experts)
        back = self._exchange(computed, receive, send)  # the outputs, in the order the slots were sent
        out = torch.empty_like(back)
        out[order] = back
        return sum_slots(out, idx.shape, u.dtype)


def is_expert_parallel(model: nn.Module) -> bool:
    """Whether `model` holds sharded experts: its MoE layers are then collectives over the ranks."""
    return any(isinstance(m, ShardedExperts) for m in model.modules())


def shard_experts(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Every MoE layer of `model` with its routed experts sharded for `rank` of `world` (in place)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("the model has no MoE layer to shard")
    for moe in layers:
        moe.experts = ShardedExperts(moe.experts, rank, world, group)
    return model
