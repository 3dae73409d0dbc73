"""The decode cache: fixed-size state per sequence slot, and the compressed entries in pages of a pool shared by all
sequences; handed to the model as per-layer `LayerState` views (nano-vllm's allocate-then-view pattern).

A page covers PAGE_TOKENS consecutive positions of one sequence: for a layer of ratio m it holds that span's
PAGE_TOKENS / m compressed entries (64 CSA entries and 64 indexer keys, or 2 HCA entries, at 256 tokens). One page
id names the same span in every layer's pool, so a sequence needs one page table (`PageTable`), not one per layer.
Capacity is the number of pages, not `slots x max_model_len`: a long sequence takes many pages, a short one few.

Pools (L = layers, n = layers with a compressor of that ratio, D = head_dim, d_I = index_head_dim, P = pages):
  window                       [L, slots, sliding_window, D]          compute dtype   per slot
  compressor.r{m}.open_kv      [n, slots, m, width]                   compute dtype   per slot (width 2D for m = 4)
  compressor.r{m}.open_score   [n, slots, m, width]                   fp32            per slot (gate + ape)
  compressor.r4.prev_kv/score  [n, slots, 4, D]                       Ca half of the last window (score fp32)
  compressor.r{m}.entries      [n, P, PAGE_TOKENS // m, D]            compute dtype   paged
  indexer.r4.*                 the same for the indexer's compressor, with d_I
kv_cache_dtype (`pool_shapes`) stores the entries (and the indexer's keys) in fp8 instead.
"""

from __future__ import annotations

import os
from collections import deque

import torch

from ..config import ModelConfig
from ..kernels.ref import kv_row_bytes
from ..model.state import CompressorState, LayerState

PAGE_TOKENS = 256          # positions per page: a multiple of every compress ratio (4, 128)


class CacheCapacityError(ValueError):
    pass


KV_CACHE_DTYPES = ("auto", "fp8", "fp8-indexer")


def pool_shapes(cfg: ModelConfig, num_slots: int, num_pages: int, dtype: torch.dtype,
                kv_cache_dtype: str = "auto") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Pool name -> (shape, dtype); layer order within a pool is layer order in the model. kv_cache_dtype "auto":
    everything in the compute dtype. "fp8-indexer": the indexer's keys as fp8 e4m3 codes with an fp32 power-of-two
    scale per key (`entry_scales`). "fp8": those, and the attention's compressed entries as packed fp8 rows uint8
    (`kernels.ref.fp8_kv_pack`: 584 bytes per entry at V4's 512 channels instead of 1,024 in bf16), the window's
    rows rounded to the same values (it keeps the compute dtype: 128 rows a slot)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    L, W, D = cfg.num_hidden_layers, cfg.sliding_window, cfg.head_dim
    if kv_cache_dtype == "fp8" and (D % 64 or D & (D - 1)):
        raise ValueError(f"kv_cache_dtype 'fp8' packs rows in blocks of 64 channels: head_dim {D} must be a power "
                         f"of two of at least 64")
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
            if who == "indexer" and kv_cache_dtype != "auto":
                shapes[f"{key}.entries"] = ((n, num_pages, PAGE_TOKENS // m, hd), torch.float8_e4m3fn)
                shapes[f"{key}.entry_scales"] = ((n, num_pages, PAGE_TOKENS // m), torch.float32)
            elif kv_cache_dtype == "fp8":
                shapes[f"{key}.entries"] = ((n, num_pages, PAGE_TOKENS // m, kv_row_bytes(hd, cfg.nope_head_dim)),
                                            torch.uint8)
            else:
                shapes[f"{key}.entries"] = ((n, num_pages, PAGE_TOKENS // m, hd), dtype)
    return shapes


def cache_bytes(cfg: ModelConfig, num_slots: int, num_pages: int, dtype: torch.dtype,
                kv_cache_dtype: str = "auto") -> int:
    shapes = pool_shapes(cfg, num_slots, num_pages, dtype, kv_cache_dtype).values()
    return sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in shapes)


def page_bytes(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one page adds to the pools (every layer's entries for PAGE_TOKENS positions)."""
    return cache_bytes(cfg, 0, 1, dtype, kv_cache_dtype)


def pages_that_fit(cfg: ModelConfig, nbytes: float, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                   num_slots: int = 1) -> int:
    """Whole pages `nbytes` hold beside `num_slots` slots' fixed state (0 if not even that fits)."""
    room = int(nbytes) - cache_bytes(cfg, num_slots, 0, dtype, kv_cache_dtype)
    return max(0, room // page_bytes(cfg, dtype, kv_cache_dtype))


def tokens_that_fit(cfg: ModelConfig, nbytes: float, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                    num_slots: int = 1) -> int:
    """Cached tokens `nbytes` hold beside `num_slots` slots' fixed state (`pages_that_fit`'s pages)."""
    return pages_that_fit(cfg, nbytes, dtype, kv_cache_dtype, num_slots) * PAGE_TOKENS


def pages_for(tokens: int) -> int:
    """Pages a sequence of `tokens` positions occupies."""
    return -(-tokens // PAGE_TOKENS)


def free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


class PageTable:
    """The pages of one sequence, in position order: page i covers positions [i, i + 1) * PAGE_TOKENS."""

    def __init__(self):
        self.pages: list[int] = []

    def __len__(self) -> int:
        return len(self.pages)


class PageAllocator:
    """The free pages of the pool (host side); `grow` gives a sequence's table the pages for more positions."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def fits(self, table: PageTable, tokens: int) -> bool:
        """Whether the free pages are enough for `table` to hold `tokens` positions."""
        return pages_for(tokens) - len(table) <= len(self.free)

    def grow(self, table: PageTable, tokens: int) -> bool:
        """Give `table` pages until it holds `tokens` positions; False (and no change) if too few are free."""
        if not self.fits(table, tokens):
            return False
        table.pages.extend(self.free.popleft() for _ in range(pages_for(tokens) - len(table)))   # (none if < 0)
        return True

    def release(self, table: PageTable) -> None:
        self.free.extend(table.pages)
        table.pages.clear()


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, num_pages: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_cache_dtype: str = "auto"):
        device = torch.device(device)
        if num_slots < 1 or num_pages < 1:
            raise CacheCapacityError(f"the cache needs at least one slot and one page; got max_num_seqs={num_slots}, "
                                     f"{num_pages} pages")
        shapes = pool_shapes(cfg, num_slots, num_pages, dtype, kv_cache_dtype)
        need, free = cache_bytes(cfg, num_slots, num_pages, dtype, kv_cache_dtype), free_bytes(device)
        if free is not None and need > free:
            raise CacheCapacityError(f"the decode cache for max_num_seqs={num_slots} and {num_pages} pages of "
                                     f"{PAGE_TOKENS} tokens needs {need / 2**30:.2f} GiB but {device} has "
                                     f"{free / 2**30:.2f} GiB free; lower max_num_seqs or the cache size")
        self.num_slots, self.num_pages, self.nbytes = num_slots, num_pages, need
        self.fp8_nope = cfg.nope_head_dim if kv_cache_dtype == "fp8" else 0
        self.pools = {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in shapes.items()}
        for name, pool in self.pools.items():
            if name.endswith("prev_score"):
                pool.fill_(float("-inf"))
        self.layers = self._views(cfg)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * PAGE_TOKENS

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
            layers.append(LayerState(self.pools["window"][i], comp, idx, self.fp8_nope))
        return layers

    def _compressor(self, key: str, j: int) -> CompressorState:
        def leaf(name: str) -> torch.Tensor | None:
            pool = self.pools.get(f"{key}.{name}")
            return None if pool is None else pool[j]
        return CompressorState(leaf("open_kv"), leaf("open_score"), leaf("prev_kv"), leaf("prev_score"),
                               leaf("entries"), leaf("entry_scales"), self.fp8_nope if key.startswith("comp") else 0)

    def reset(self, slot: int) -> None:
        """Make `slot` hold an empty sequence (before its first token is written)."""
        for layer in self.layers:
            layer.reset(slot)
