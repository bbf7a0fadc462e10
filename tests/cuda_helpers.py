"""A torch module for the cuda:N tests, in a module of its own so that a worker
process can import it (tests/test_cuda.py is skipped where torch sees no GPU)."""

from __future__ import annotations

import torch

ROWS = 100
WIDTH = 8


class Lookup(torch.nn.Module):
    """An embedding table whose row i holds i in each of its WIDTH columns; an input
    ``x`` of shape (batch, 1) gives ``y`` of shape (batch, WIDTH). An index out of
    range trips a device-side assert on a GPU, which leaves the process's CUDA
    context unusable: every later CUDA call there fails."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(ROWS, WIDTH)
        with torch.no_grad():
            rows = torch.arange(ROWS, dtype=torch.float32)[:, None]
            self.table.weight.copy_(rows.expand(ROWS, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x).sum(dim=1)


#: What Hungry takes per item of its batch, on top of its inputs.
GIB_PER_ITEM = 3


class Hungry(torch.nn.Module):
    """``y = 2x``, taking GIB_PER_ITEM GiB of device memory per item while it runs: a
    batch of 64 (192 GiB) runs out of any GPU's memory, one of 8 (24 GiB) does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(len(x) * GIB_PER_ITEM << 30, dtype=torch.uint8, device=x.device)
        del scratch
        return x * 2
