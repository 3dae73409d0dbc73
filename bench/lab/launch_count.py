"""Question: which kernels does one decode step launch per layer, and from which line of the model?

Runs one graph-runner decode step (`DecodeGraphs` without capture: the ops a captured graph holds) of a V4-shaped
model shrunk to CPU size, on the Triton table under TRITON_INTERPRET=1, and records every Triton launch and every
ATen op that would launch a GPU kernel (views, metadata and allocations excluded), each attributed to its layer and
to the model source line that issued it. Prints kernels per layer by kind and the lines that issue the most.

    TRITON_INTERPRET=1 python bench/lab/launch_count.py [--batch 2] [--context 300] [--out counts.json]

A CPU count: the CUDA path takes the same Python branches (the Triton table on both), so the per-layer counts equal
a captured graph's nodes except where a kernel's CPU plan differs from its CUDA plan (split-K choices).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dsv4.checkpoint.dummy import dummy_model  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.kernels import Ops  # noqa: E402
from dsv4.runtime.cache import KVCache  # noqa: E402
from dsv4.runtime.engine import Engine  # noqa: E402
from dsv4.runtime.graphs import DecodeGraphs  # noqa: E402
from dsv4.runtime.params import SamplingParams  # noqa: E402

FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias",
        "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride",
        "set_", "record_stream", "resize_"}


def small_v4() -> ModelConfig:
    """V4-Flash's structure (head_dim 512, 64-wide rope, window 128, CSA ratio 4 + indexer, HCA ratio 128, hash and
    biased MoE with a shared expert) at widths the interpreter runs in seconds; layers S, C, H, C."""
    return ModelConfig.flash().__class__(**{**ModelConfig.flash().__dict__, **dict(
        vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, q_lora_rank=256,
        o_groups=2, o_lora_rank=256, n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=256,
        num_hash_layers=1, index_n_heads=4, index_head_dim=128, index_topk=16,
        compress_ratios=(0, 4, 128, 4, 0))})


class Recorder(TorchDispatchMode):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in FREE):
            self.log("aten." + name)
        return func(*args, **(kwargs or {}))


def model_line(root: str) -> str:
    """The innermost frame of the dsv4 package outside dsv4/kernels (the model line that asked for the kernel)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/dsv4/" in frame.filename and "/dsv4/kernels/" not in frame.filename:
            return f"{os.path.relpath(frame.filename, root)}:{frame.lineno} {frame.line}"
    return "?"


def use_table(model: torch.nn.Module, table: Ops) -> None:
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = table


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=140)
    ap.add_argument("--format", default="nvfp4-experts")
    ap.add_argument("--as-gpu", action="store_true", help="plan every call as for an H200 (132 SMs, the GPU's choices "
                    "of split-K, streams aside) while the kernels still run interpreted")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the Triton table on the CPU)")
    import triton.runtime.interpreter as interp

    root = str(Path(__file__).resolve().parents[2])
    cfg = small_v4()
    table = Ops.triton()                                # the decode step's: the GPU's table (fallbacks are counted
    model = dummy_model(cfg, args.format, "cpu", torch.float32, table)     # by their ATen ops, as on the GPU)
    model.prepare_for_kernels_()                        # placed as for that table, then prefilled on the reference
    use_table(model, Ops.reference())
    kw = dict(max_num_seqs=args.batch, max_model_len=args.context + 8, num_cache_pages=4 * args.batch,
              max_num_batched_tokens=512)
    engine = Engine(model, enforce_eager=True, **kw)
    engine.cache = KVCache(cfg, args.batch + 1, kw["num_cache_pages"], torch.float32)
    engine.graphs = DecodeGraphs(model, engine.cache.layers, args.batch, kw["max_model_len"], pad_slot=args.batch,
                                 capture=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        engine.add_request(torch.randint(2, cfg.vocab_size, (args.context,), generator=gen).tolist(),
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while any(s.num_cached < args.context for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()                                   # prefill, on the reference table (fast on the CPU)
    if args.as_gpu:
        import dsv4.kernels.attention as attention_kernels
        import dsv4.kernels.dispatch as dispatch
        import dsv4.kernels.gemv_launch as gemv_launch
        from dsv4.kernels.policy import Device
        gpu = Device(sms=132, gpu=True, interpreted=True)
        dispatch.device_info = lambda device: gpu
        attention_kernels.num_sms = gemv_launch.num_sms = lambda device: 132
    use_table(model, table)

    where = ["outside"]
    events: list[tuple[str, str, str]] = []

    inside = [False]                                    # within an interpreted launch: its copies are not kernels

    def log(kind: str) -> None:
        if not inside[0]:
            events.append((where[0], kind, model_line(root)))

    hooks = []
    for i, blk in enumerate(model.layers):
        ratio = cfg.compress_ratio(i)
        tag = f"layer {i} ({'CSA' if ratio == 4 else 'HCA' if ratio else 'SWA'})"
        hooks.append(blk.register_forward_pre_hook(lambda m, a, tag=tag: where.__setitem__(0, tag)))
        hooks.append(blk.register_forward_hook(lambda m, a, o: where.__setitem__(0, "outside")))
    run = interp.InterpretedFunction.run

    def counted(self, *a, **k):
        log("triton." + self.fn.__name__)
        inside[0] = True
        try:
            return run(self, *a, **k)
        finally:
            inside[0] = False

    interp.InterpretedFunction.run = counted
    try:
        with Recorder(log):
            engine.step()                               # one decode step through the graph runner
    finally:
        interp.InterpretedFunction.run = run
        for h in hooks:
            h.remove()
    per_place = collections.defaultdict(collections.Counter)
    lines = collections.defaultdict(collections.Counter)
    for place, kind, line in events:
        per_place[place][kind] += 1
        lines[place][line] += 1
    res = {"batch": args.batch, "context": args.context, "format": args.format,
           "per_place": {p: dict(c.most_common()) for p, c in per_place.items()},
           "lines": {p: dict(c.most_common()) for p, c in lines.items()}}
    for place, counts in per_place.items():
        print(f"\n{place}: {sum(counts.values())} kernels "
              f"({sum(v for k, v in counts.items() if k.startswith('triton.'))} Triton)")
        print("   by kind: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
        for line, n in lines[place].most_common():
            print(f"  {n:4d}  {line}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
