"""The decode runner of `runtime.graphs` (static buffers, padded buckets, the device page table) run without capture
on the CPU, inside the engine, against the engine's plain ragged step: identical greedy tokens for sequences that
decode across window closes, CSA / HCA entries and page boundaries while the batch shrinks through several buckets,
with a preempted-and-recomputed sequence and a slot reused by a new request. (The capture itself needs CUDA; the GPU
run of `bench/e2e.py --modes graphs,eager` compares the two there.)"""

import pytest
import torch

import dsv4
import runtime_fixtures as rf
from dsv4.runtime.cache import KVCache
from dsv4.runtime.engine import Engine
from dsv4.runtime.graphs import DecodeGraphs
from dsv4.runtime.params import SamplingParams

LENGTHS = (5, 126, 250, 31, 3)                # prompts; decoding crosses 128 and 256 (window, HCA, pages)
NEW = (40, 9, 20, 14, 30)                     # tokens to generate: the batch shrinks 5 -> 4 -> 3 -> 2 -> 1


def generate(engine: Engine, prompts) -> list[list[int]]:
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, NEW)]
    while engine.has_unfinished():
        engine.step()
    return [list(s.tracker.token_ids) for s in seqs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_decode_steps_give_the_plain_steps_tokens(async_scheduling):
    model = dsv4.load(rf.variant("wide"))
    prompts = [rf.prompt_ids(n, seed=40 + i) for i, n in enumerate(LENGTHS)]
    plain = Engine(model, max_num_seqs=4, max_model_len=320, num_cache_pages=4, max_num_batched_tokens=64)
    want = generate(plain, prompts)
    engine = Engine(model, max_num_seqs=4, max_model_len=320, num_cache_pages=4, max_num_batched_tokens=64,
                    async_scheduling=async_scheduling)
    # the CUDA layout on the CPU: one more cache slot for the padding rows, and the runner without capture
    engine.cache = KVCache(model.config, 5, 4, torch.float32)
    engine.graphs = DecodeGraphs(model, engine.cache.layers, 4, 320, pad_slot=4, capture=False, lengths=[128, 320])
    assert engine.graphs.buckets == [1, 2, 4]
    runs, shapes = [], set()                           # (rows, launched ahead) per step of the runner
    original, forward = engine.graphs.replay, engine.graphs._forward
    engine.graphs.replay = lambda step, ids=None: runs.append((len(step.ids), ids is not None)) or original(step, ids)
    engine.graphs._forward = lambda bucket, length: shapes.add((bucket, length)) or forward(bucket, length)
    got = generate(engine, prompts)
    assert got == want
    assert {1, 2, 3, 4} <= {n for n, _ in runs}        # every bucket, padded (3 -> 4) and exact
    ahead = sum(a for _, a in runs)                    # with async scheduling most decode steps launch ahead
    assert ahead > len(runs) // 2 if async_scheduling else ahead == 0
    assert {4, 2, 1} <= {b for b, _ in shapes} and {128, 320} == {n for _, n in shapes}   # both length buckets
    assert engine.scheduler.num_preemptions > 0 and plain.scheduler.num_preemptions > 0
    # the padding slot holds no sequence's state that a real one reads: slot 4's ring was written, the others'
    # rows are their own
    assert engine.cache.layers[0].window[4].abs().sum() > 0


def test_graph_check_script_compares_the_two_modes(tmp_path):
    """bench/graph_check.py (the GPU run's graphs-vs-eager token check) on the CPU: the padded path."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "bench/graph_check.py", "--model", "tiny", "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "graph_check.json").read_text())
    assert res["identical"] and len(res["per_request"]) == 6 and not res["captured"] and res["async_identical"]


def test_cache_dtype_check_script_reports_each_cache_against_auto(tmp_path):
    """bench/cache_dtype_check.py (the GPU run's fp8-cache report) on the CPU: plain steps equal the default cache's
    (no graphs there), and the fp8 cache moves the log-probabilities (so the script did switch caches)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "bench/cache_dtype_check.py", "--model", "tiny", "--new", "2", "--out",
                           str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "cache_dtype_check.json").read_text())["against_auto"]
    assert set(res) == {"plain", "fp8-indexer", "fp8"}
    assert res["plain"]["first_difference"] == [None, None, None] and res["plain"]["max_logprob_diff"] == 0.0
    assert res["fp8"]["max_logprob_diff"] > 0.0 and res["fp8"]["same_steps"] > 0


def test_length_buckets_grow_by_four_up_to_max_model_len():
    from dsv4.runtime.graphs import length_buckets
    assert length_buckets(320) == [320]
    assert length_buckets(65536) == [4096, 16384, 65536]
    assert length_buckets(100_000) == [4096, 16384, 65536, 100_000]


def test_a_one_token_prefill_chunk_beside_decodes_takes_the_plain_step(caplog):
    """max_num_batched_tokens = max_num_seqs: while three sequences decode, a long prompt gets one token of budget a
    step, a chunk of one token that is not its last: such a step is not a decode step (that sequence gets no token
    from it), so it runs plain and every sequence keeps the tokens of the plain engine."""
    model = dsv4.load(rf.variant("wide"))
    prompts = [rf.prompt_ids(n, seed=60 + i) for i, n in enumerate((3, 4, 5, 40))]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(engine):
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [list(s.tracker.token_ids) for s in seqs]

    want = run(Engine(model, max_num_seqs=4, max_model_len=320, num_cache_pages=8, max_num_batched_tokens=4))
    engine = Engine(model, max_num_seqs=4, max_model_len=320, num_cache_pages=8, max_num_batched_tokens=4)
    engine.cache = KVCache(model.config, 5, 8, torch.float32)
    engine.graphs = DecodeGraphs(model, engine.cache.layers, 4, 320, pad_slot=4, capture=False, lengths=[320])
    one_token_chunks, schedule = [], engine.scheduler.schedule

    def recording():
        plan = schedule()
        one_token_chunks.append(any(n == 1 and s.num_pending > 1 for s, n in plan) and all(n == 1 for _, n in plan))
        return plan
    engine.scheduler.schedule = recording
    runs, replay = [], engine.graphs.replay
    engine.graphs.replay = lambda step, ids=None: runs.append(len(step.ids)) or replay(step, ids)
    assert run(engine) == want
    assert any(one_token_chunks) and runs             # the case happened, and the runner ran the decode steps
    assert "failed" not in caplog.text                # no step's logits disagreed with its sampled rows


def test_graph_check_script_runs_on_two_ranks(tmp_path):
    """bench/graph_check.py --tensor-parallel-size 2 (the two-GPU run's graphs-vs-eager check) on gloo ranks: the
    script runs end to end (on the CPU both engines step plainly)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "bench/graph_check.py", "--model", "tiny", "--format", "bf16",
                           "--tensor-parallel-size", "2", "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "graph_check.json").read_text())
    assert res["identical"] and len(res["per_request"]) == 6 and res["tensor_parallel_size"] == 2
