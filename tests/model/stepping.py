"""Driving the batched step by hand in tests: logits kept by position on top of SequenceGroup."""

from __future__ import annotations

import torch

from megafuse.model import CacheLayout, SequenceGroup


def random_tokens(cfg, length: int, seed: int) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver(SequenceGroup):
    """A SequenceGroup on `model.step` that keeps the logits each position produced."""

    def __init__(self, model, layout: CacheLayout, prompts: list[list[int]]):
        super().__init__(model.cfg, layout, prompts, model.embed.weight.device)
        self.model = model
        self.logits: list[dict[int, torch.Tensor]] = [{} for _ in prompts]

    def step(self, plan, trim: bool = False, rows: int | None = None, decoder_rows: int | None = None):
        batch, logits = super().step(lambda b, c: self.model.step(b, c), plan, trim, rows, decoder_rows)
        dec, r = batch.decoder, 0
        for out in logits:
            for row in out:
                self.logits[int(dec.slots[r])][int(dec.positions[r])] = row
                r += 1
        return batch

    def stacked(self, i: int, positions) -> torch.Tensor:
        return torch.stack([self.logits[i][p] for p in positions])
