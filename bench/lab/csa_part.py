"""Question: What does a CSA layer's attention part cost a decode step, against issue 38's targets?

Issue 38 asks the CSA layer's attention part (compressors, indexer, top-k and attention; the projections excluded)
to take at most 20 us for one sequence at 8K context, 40 us at 128K, and 150 us for 64 sequences at 8K. No other
script times that part alone: `bench/e2e.py` times whole layers. This runs exactly the calls a CSA layer's cached
decode step makes after its projections (`model.attention.Attention._cached`), on V4-Flash's shapes and random
caches filled to the context:

    compressor.compress      the attention compressor's step (width 2 x head_dim, ratio 4, overlapping windows)
                             and the indexer compressor's (width 2 x index_head_dim) in the same launch
    norm_rope                the indexer's queries rotated
    indexer.index_picks      scores of every visible key, then the top-k (index_topk)
    attention.sparse_attention  window + picked entries, the ring written in the launch (and the split's combine),
                             the queries normalised and rotated and the output rotated back in it, as the model
                             calls it

Each case is timed whole and call by call (`common.Timer`: a CUDA graph of the calls over four input sets whose
positions are four consecutive decode positions, so one in four closes a compressor window, as decoding does).

    python bench/lab/csa_part.py [--batches 1,64] [--contexts 8192,131072] [--out DIR]   # on the GPU
    python bench/lab/csa_part.py --toy                                                 # CPU dry run

Prints one line per (batch, context): us for the whole part and for each call; writes csa_part.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer, lab_parser, median_us, record_failure, write_record  # noqa: E402

from dsv4.config import ModelConfig  # noqa: E402
from dsv4.kernels import attention, compressor, indexer, norm_rope  # noqa: E402
from dsv4.kernels.ref import SecondCompressor  # noqa: E402
from dsv4.kernels.steps import StepTokens  # noqa: E402
from dsv4.model.state import CompressorState  # noqa: E402
from dsv4.runtime.cache import PAGE_TOKENS  # noqa: E402

RATIO = 4                                      # CSA
TARGETS = {(1, 8192): 20.0, (1, 131072): 40.0, (64, 8192): 150.0}   # issue 38, us


def compressor_state(B: int, pages: int, head_dim: int, dtype, dev, gen) -> CompressorState:
    """An overlapping (ratio-4) compressor's state for B slots with `pages` pages of random entries."""
    width = 2 * head_dim
    return CompressorState(torch.randn(B, RATIO, width, device=dev, generator=gen).to(dtype),
                           torch.randn(B, RATIO, width, device=dev, generator=gen),
                           torch.randn(B, RATIO, head_dim, device=dev, generator=gen).to(dtype),
                           torch.randn(B, RATIO, head_dim, device=dev, generator=gen),
                           torch.randn(pages, PAGE_TOKENS // RATIO, head_dim, device=dev, generator=gen).to(dtype))


def step_inputs(cfg: ModelConfig, B: int, position: int, pages: list, dtype, dev, gen) -> dict:
    """One decode token per sequence at `position`: the projections' outputs the part reads."""
    H, D, IH, ID = cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
    half = cfg.qk_rope_head_dim // 2
    angle = torch.rand(B, half, device=dev, generator=gen) * 6
    rand = lambda *shape: torch.randn(*shape, device=dev, generator=gen).to(dtype)  # noqa: E731
    return dict(steps=StepTokens.build(tuple(range(B)), (position,) * B, (1,) * B, pages, dev),
                cos=angle.cos(), sin=angle.sin(), q=rand(B, H, D), kv=rand(B, D),
                kv_c=rand(B, 2 * D), score_c=rand(B, 2 * D), kv_i=rand(B, 2 * ID), score_i=rand(B, 2 * ID),
                iq=rand(B, IH, ID), weights=rand(B, IH))


def main():
    ap = lab_parser("CPU dry run at the tiny model's shapes (checks the script)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--contexts", default="8192,131072")
    args = ap.parse_args()
    cfg = ModelConfig.preset("v4-flash")
    if args.toy:
        args.device, args.batches, args.contexts, args.rounds, cfg = "cpu", "1,3", "600", 1, ModelConfig.tiny()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, label = Timer(dev), "toy" if args.toy else dev.type
    H, D, ID = cfg.num_attention_heads, cfg.head_dim, cfg.index_head_dim
    sinks = torch.randn(H, device=dev, generator=gen)
    norm_w = torch.rand(D, device=dev, generator=gen) + 0.5
    norm_iw = torch.rand(ID, device=dev, generator=gen) + 0.5
    ape_c = torch.randn(RATIO, 2 * D, device=dev, generator=gen)
    ape_i = torch.randn(RATIO, 2 * ID, device=dev, generator=gen)
    names = ("compressors", "index queries", "index picks", "attention")
    print(f"{label:5s} {'B':>4s} {'context':>8s} | {'part us':>8s} {'target':>7s} | "
          + " ".join(f"{n:>14s}" for n in names))
    rows = []
    for B in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            per_seq = -(-(context + 4) // PAGE_TOKENS)
            pages = [tuple(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
            main_state = compressor_state(B, B * per_seq, D, dtype, dev, gen)
            index_state = compressor_state(B, B * per_seq, ID, dtype, dev, gen)
            ring = torch.randn(B, cfg.sliding_window, D, device=dev, generator=gen).to(dtype)
            sets = [step_inputs(cfg, B, context + i, pages, dtype, dev, gen) for i in range(4)]
            max_keys = (context + 4) // RATIO

            def part(x, picks=None, only=None):
                """The part's calls in the model's order (only: just that one, reading `picks` computed before)."""
                s = x["steps"]
                if only in (None, 0):
                    second = SecondCompressor(x["kv_i"], x["score_i"], ape_i, index_state, norm_iw, cfg.rms_norm_eps)
                    compressor.compress(x["kv_c"], x["score_c"], ape_c, s, main_state, RATIO, x["cos"], x["sin"],
                                        norm_w, cfg.rms_norm_eps, 1, second=second)
                iq = x["iq"]
                if only in (None, 1):
                    iq = norm_rope.norm_rope(iq, x["cos"], x["sin"])
                if only in (None, 2):
                    picks = indexer.index_picks(iq, x["weights"], index_state.entries, s, cfg.index_topk, RATIO,
                                                ID ** -0.5, max_keys, cfg.index_n_heads ** -0.5)
                if only in (None, 3):
                    attention.sparse_attention(x["q"], x["kv"], ring, main_state.entries, picks, s, RATIO, sinks,
                                               D ** -0.5, max_keys, update_ring=True, rope=(x["cos"], x["sin"]),
                                               q_eps=cfg.rms_norm_eps)
                return picks

            picked = [part(x) for x in sets]           # each set's picks, for the attention timed alone
            row = dict(batch=B, context=context)
            try:
                row["part_us"] = median_us(timer, [lambda x=x: part(x) for x in sets], args.rounds)
                row["calls_us"] = {}
                for i, n in enumerate(names):
                    row["calls_us"][n] = median_us(timer, [lambda x=x, p=p, i=i: part(x, p, i)
                                                           for x, p in zip(sets, picked)], args.rounds)
            except Exception as e:                    # a case that does not fit or run: say so, go on
                record_failure(row, e, f"{label:5s} {B:4d} {context:8d}")
                rows.append(row)
                continue
            target = TARGETS.get((B, context))
            row["target_us"] = target
            print(f"{label:5s} {B:4d} {context:8d} | {row['part_us']:8.1f} {target or '-':>7} | "
                  + " ".join(f"{row['calls_us'][n]:14.1f}" for n in names), flush=True)
            rows.append(row)
            del main_state, index_state, ring, sets, picked
    write_record(args.out, "csa_part.json", dict(device=str(dev), rows=rows))


if __name__ == "__main__":
    main()
