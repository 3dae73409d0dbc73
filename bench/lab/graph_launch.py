"""Question: Does a decode step's GPU wait for the host while the step's CUDA graph is launched?

In `bench/e2e.py --sequence` the profiled step's first kernel starts 359-520 us after the step's input copy (8
layers, batch 1, H100; bench/results/round-46.md), which would be a graph launch holding the GPU for a sixth of the
step. This times it without the profiler: on the e2e engine (dummy V4-Flash weights, 8K context) after three
warm-up steps, the host time of the step's graph `replay()` call alone (no synchronization), the wall time of the
replay and a synchronize, and the wall time of a whole `engine.step()` (scheduling, the input copies, the replay,
the sampler, reading the tokens back), medians over 20 / 20 / 10 runs. Then, with async scheduling off and on
(`Engine.async_scheduling`: the next decode step launched before this one's tokens are read back), the mean time
of a step over 20 steps in a row with no synchronization between them, in turns, three times each. Each timing
follows an untimed step in its mode and a synchronization, and ends with a synchronization: with async scheduling
the step ahead of the first ran before the timer and the one launched by the last runs inside it, so either way
the timer holds 20 steps' device work.

    python bench/lab/graph_launch.py [--layers 8] [--batch 1] [--context 8192]     # on the GPU

Prints two lines per (layers, batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common, e2e

from common import dummy_bench_model  # noqa: E402
from e2e import engine_at_context  # noqa: E402


def median_us(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="8")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("graph_launch.py times CUDA graph launches: it needs a GPU")
    for layers in map(int, args.layers.split(",")):
        _, _, _, model = dummy_bench_model("v4-flash", layers, "nvfp4-experts", None)
        for batch in map(int, args.batch.split(",")):
            engine, _ = engine_at_context(model, batch, args.context, 200, torch.Generator().manual_seed(0))
            engine.async_scheduling = False
            for _ in range(3):
                engine.step()
            runner = engine.graphs
            key = min(k for k in runner.graphs if k[0] >= batch and k[1] >= args.context)   # the step's bucket
            launch = runner.graphs[key].replay

            def launch_and_wait():
                launch()
                torch.cuda.synchronize()
            host = median_us(launch, 20)
            torch.cuda.synchronize()
            print(f"layers {layers} batch {batch}: launch (host) {host:.0f} us; launch and "
                  f"wait {median_us(launch_and_wait, 20):.0f} us; engine.step "
                  f"{median_us(lambda: (engine.step(), torch.cuda.synchronize()), 10):.0f} us", flush=True)
            in_a_row = {False: [], True: []}
            for _ in range(3):
                for mode in (False, True):
                    engine.async_scheduling = mode
                    engine.step()           # untimed: with async scheduling the timer starts with a step ahead
                    in_a_row[mode].append(median_us(lambda: ([engine.step() for _ in range(20)],
                                                              torch.cuda.synchronize()), 1) / 20)
            print(f"layers {layers} batch {batch}: 20 steps in a row, us a step: async scheduling off "
                  + " / ".join(f"{t:.0f}" for t in in_a_row[False]) + ", on "
                  + " / ".join(f"{t:.0f}" for t in in_a_row[True]), flush=True)
            del engine
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
