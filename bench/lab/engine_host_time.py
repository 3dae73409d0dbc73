"""Question: How much host time does the engine spend on a decode step around the model, and which part of it does
the device wait for?

The engine (`runtime.engine.Engine`) with its decode runner's model replaced by a stub that returns logits at once,
so what is timed is the host's work per decode step: scheduling, the runner's inputs (the step's ids, positions and
slots into its buffer, and their copy), launching the sampler, rendering the previous step's tokens (detokenization,
stop checks, callbacks), reading the tokens back and accepting them. Rendering runs while the device computes the
step (`Engine.step`), so the device waits only for the rest: the column "device waits" is the step's time less
rendering. Async scheduling is off here (it launches the next step before this one's tokens are read back, so the
device waits for none of this while the step runs; `bench/lab/graph_launch.py` times it on the GPU).

    python bench/lab/engine_host_time.py [--batches 1,64,256] [--steps 30] [--out DIR]
    python bench/lab/engine_host_time.py --toy          # a dry run (checks the script)

The tiny test model (its logits 512 wide: the tensor work here is a GPU's kernels, not host time); greedy requests
(their sampling is one argmax; a filtered batch adds one kernel launch on a GPU, while the CPU would time its
reference sampler); best of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4

from dsv4.checkpoint.dummy import dummy_model  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.runtime.engine import Engine  # noqa: E402
from dsv4.runtime.graphs import DecodeGraphs  # noqa: E402
from dsv4.runtime.params import SamplingParams  # noqa: E402

PARTS = ("schedule", "runner inputs", "sampler launch", "render", "read back", "accept")


class StubRunner(DecodeGraphs):
    """The decode runner without capture whose padded step returns fixed logits at once: its host work (the step's
    inputs into the pinned buffer and their copy) is timed, the model is not."""

    def __init__(self, engine: Engine, batch: int):
        super().__init__(engine.model, engine.cache.layers, batch, engine.max_model_len, pad_slot=batch,
                         capture=False)
        self.logits = torch.zeros(self.buckets[-1], engine.model.config.vocab_size)

    def _forward(self, bucket: int, length: int) -> torch.Tensor:
        return self.logits[:bucket]


def measure(model, batch: int, params: SamplingParams, steps: int) -> dict:
    engine = Engine(model, max_num_seqs=batch, max_model_len=steps + 16, num_cache_pages=batch + 1,
                    max_num_batched_tokens=max(batch * 4, 64), async_scheduling=False)
    engine.graphs = StubRunner(engine, batch)
    seqs = [engine.add_request([5, 6, 7], params) for _ in range(batch)]
    while any(s.tracker.num_sampled == 0 for s in seqs):
        engine.step()                                      # prefill (the model runs: not timed)
    parts = dict.fromkeys(PARTS, 0.0)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            parts[name] += time.perf_counter() - t
            return out
        return wrapper
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.graphs.run = timed("runner inputs", engine.graphs.run)
    engine._launch_sampling = timed("sampler launch", engine._launch_sampling)
    engine._render = timed("render", engine._render)
    engine._read_samples = timed("read back", engine._read_samples)
    engine._accept = timed("accept", engine._accept)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = (time.perf_counter() - t) / steps
    out = {name: parts[name] / steps * 1e3 for name in PARTS}
    out.update(step_ms=total * 1e3, device_waits_ms=(total - parts["render"] / steps) * 1e3)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--toy", action="store_true", help="batches 1,4 and 3 steps (checks the script)")
    args = ap.parse_args(argv)
    if args.toy:
        args.batches, args.steps = "1,4", 3
    label = "toy" if args.toy else "cpu"
    torch.set_num_threads(1)
    model = dummy_model(ModelConfig.tiny(), "bf16", dtype=torch.float32)
    mixes = {"greedy": SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)}
    rows = []
    print(f"{label:5s} {'mix':11s} {'B':>4s} | {'step ms':>8s} {'device waits':>12s} | "
          + " ".join(f"{p:>14s}" for p in PARTS), flush=True)
    for batch in map(int, args.batches.split(",")):
        for name, params in mixes.items():
            best = min((measure(model, batch, params, args.steps) for _ in range(3)), key=lambda r: r["step_ms"])
            rows.append(dict(mix=name, B=batch, **best))
            print(f"{label:5s} {name:11s} {batch:4d} | {best['step_ms']:8.3f} {best['device_waits_ms']:12.3f} | "
                  + " ".join(f"{best[p]:14.3f}" for p in PARTS), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_host_time.json").write_text(json.dumps(dict(device="cpu", rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
