"""Collectives of one tensor-parallel group (the TP ranks of one pipeline stage), over torch.distributed.

The model holds a `Communicator` only where its stage has tp > 1; with tp = 1 it holds None and runs no collective
and no copy. `all_reduce` sums partial outputs (attention's wo_b, the MoE, the vocab-split embedding): on CUDA through
torch's symmetric-memory one-shot all-reduce (`torch.ops.symm_mem.one_shot_all_reduce`: every rank reads its peers'
buffers over NVLink and sums, one kernel, no NCCL launch) for messages up to `ONE_SHOT_MAX_BYTES` in the dtype it
was set up for, through NCCL otherwise; on CPU through gloo. `gather_last` concatenates the vocab-split head's logits.

Every rank receives the same bits (NCCL's and gloo's rings reduce each element once and pass the sum on; the one-shot
kernel sums the peers' buffers in the same order on every rank): the replicated parts of the model (mHC, the
indexer's top-k, the caches) rely on it to stay identical across ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Largest all-reduce that takes the one-shot symmetric-memory path (decode-sized messages: 64 tokens x 7168 x bf16 is
# 0.9 MiB); larger ones go to NCCL, whose ring is bandwidth-optimal. Not tuned yet (docs/parallel.md).
ONE_SHOT_MAX_BYTES = 4 << 20


def one_shot_available(device: torch.device) -> bool:
    """Whether torch offers the symmetric-memory one-shot all-reduce for `device` (CUDA builds of torch >= 2.5)."""
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError:
        return False
    return hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "one_shot_all_reduce")


class Communicator:
    def __init__(self, group: dist.ProcessGroup, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 one_shot: bool = True):
        """group: this stage's TP ranks; device: where the tensors live. one_shot=False (or a device without it)
        keeps every all-reduce on the process group's backend."""
        self.group, self.device, self.dtype = group, torch.device(device), dtype
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._buffer = None          # the symmetric buffer (ONE_SHOT_MAX_BYTES in `dtype`), when used
        if one_shot and one_shot_available(self.device):
            import torch.distributed._symmetric_memory as symm_mem

            self._buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=self.device)
            symm_mem.rendezvous(self._buffer, group.group_name)

    @property
    def path(self) -> str:
        """The all-reduce in use: "symm_mem one-shot + nccl" or the backend's name ("nccl", "gloo")."""
        backend = dist.get_backend(self.group)
        return f"symm_mem one-shot + {backend}" if self._buffer is not None else backend

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group (x may be overwritten; use the result)."""
        if self._buffer is not None and x.dtype == self.dtype and x.numel() <= self._buffer.numel():
            staged = self._buffer[:x.numel()]
            staged.copy_(x.reshape(-1))
            return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group.group_name).view_as(x)
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[..., sizes[rank]] on each rank -> [..., sum(sizes)] on every rank, in rank order (uneven sizes are padded
        for the all-gather and cut after)."""
        width = max(sizes)
        local = F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)
