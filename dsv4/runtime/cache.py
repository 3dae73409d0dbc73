"""The decode cache: one pool per kind of state, sized for `num_slots` sequences of up to `max_len` tokens,
handed to the model as per-layer `LayerState` views (nano-vllm's allocate-then-view pattern).

Pools (L = layers, n = layers with a compressor of that ratio, D = head_dim, d_I = index_head_dim):
  window                       [L, slots, sliding_window, D]          compute dtype
  compressor.r{m}.open_kv      [n, slots, m, width]                   compute dtype (width = 2D for m = 4, else D)
  compressor.r{m}.open_score   [n, slots, m, width]                   fp32 (gate + ape)
  compressor.r4.prev_kv/score  [n, slots, 4, D]                       Ca half of the last window (score fp32)
  compressor.r{m}.entries      [n, slots, max_len // m, D]            compute dtype
  indexer.r4.*                 the same for the indexer's compressor, with d_I
Every slot has room for max_len tokens, so admitting a sequence needs only a free slot.
"""

from __future__ import annotations

import os

import torch

from ..config import ModelConfig
from ..model.state import CompressorState, LayerState


class CacheCapacityError(ValueError):
    pass


def pool_shapes(cfg: ModelConfig, num_slots: int, max_len: int,
                dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Pool name -> (shape, dtype); layer order within a pool is layer order in the model."""
    L, W, D = cfg.num_hidden_layers, cfg.sliding_window, cfg.head_dim
    shapes = {"window": ((L, num_slots, W, D), dtype)}
    ratios = [cfg.compress_ratio(i) for i in range(L)]
    for m in sorted({r for r in ratios if r}):
        n = ratios.count(m)
        parts = [("compressor", D)] + ([("indexer", cfg.index_head_dim)] if m == 4 else [])
        for who, hd in parts:
            width = 2 * hd if m == 4 else hd
            key = f"{who}.r{m}"
            shapes[f"{key}.open_kv"] = ((n, num_slots, m, width), dtype)
            shapes[f"{key}.open_score"] = ((n, num_slots, m, width), torch.float32)
            if m == 4:
                shapes[f"{key}.prev_kv"] = ((n, num_slots, m, hd), dtype)
                shapes[f"{key}.prev_score"] = ((n, num_slots, m, hd), torch.float32)
            shapes[f"{key}.entries"] = ((n, num_slots, max_len // m, hd), dtype)
    return shapes


def cache_bytes(cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> int:
    shapes = pool_shapes(cfg, num_slots, max_len, dtype).values()
    return sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in shapes)


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        device = torch.device(device)
        if num_slots < 1 or max_len < 1:
            raise CacheCapacityError(f"the cache needs at least one slot and one position; got max_num_seqs="
                                     f"{num_slots}, max_model_len={max_len}")
        shapes = pool_shapes(cfg, num_slots, max_len, dtype)
        need, free = cache_bytes(cfg, num_slots, max_len, dtype), _free_bytes(device)
        if free is not None and need > free:
            raise CacheCapacityError(f"the decode cache for max_num_seqs={num_slots} x max_model_len={max_len} "
                                     f"needs {need / 2**30:.2f} GiB but {device} has {free / 2**30:.2f} GiB free; "
                                     "lower max_num_seqs or max_model_len")
        self.num_slots, self.max_len, self.nbytes = num_slots, max_len, need
        self.pools = {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in shapes.items()}
        for name, pool in self.pools.items():
            if name.endswith("prev_score"):
                pool.fill_(float("-inf"))
        self.layers = self._views(cfg)

    def _views(self, cfg: ModelConfig) -> list[LayerState]:
        seen: dict[int, int] = {}          # ratio -> layers of that ratio so far
        layers = []
        for i in range(cfg.num_hidden_layers):
            m = cfg.compress_ratio(i)
            comp = idx = None
            if m:
                j = seen[m] = seen.get(m, -1) + 1
                comp = self._compressor(f"compressor.r{m}", j)
                idx = self._compressor(f"indexer.r{m}", j) if m == 4 else None
            layers.append(LayerState(self.pools["window"][i], comp, idx))
        return layers

    def _compressor(self, key: str, j: int) -> CompressorState:
        get = lambda leaf: self.pools[f"{key}.{leaf}"][j] if f"{key}.{leaf}" in self.pools else None  # noqa: E731
        return CompressorState(get("open_kv"), get("open_score"), get("prev_kv"), get("prev_score"), get("entries"))

    def reset(self, slot: int) -> None:
        """Make `slot` hold an empty sequence (before its first token is written)."""
        for layer in self.layers:
            layer.reset(slot)
