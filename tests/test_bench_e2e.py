"""bench/e2e.py at toy sizes on the CPU: every case runs through the engine and lands in e2e.json, and the byte
floor counts what a step reads (all weights once every expert is touched; the cache rows grow with context)."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import e2e  # noqa: E402
from dsv4.checkpoint.dummy import dummy_model  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.runtime.engine import Engine  # noqa: E402


def test_toy_run_writes_every_case(tmp_path):
    res = e2e.main(["--toy", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "e2e.json").read_text())["decode"] == res["decode"]
    assert not res["errors"]
    assert len(res["decode"]) == 2 * 2 * 2 * 2 and all(c["step_ms"] > 0 and c["aten_ops"] > 0 for c in res["decode"])
    assert len(res["per_layer"]) == 2 * 2 * 2 and len(res["prefill"]) == 2 * 2
    assert isinstance(res["hf"]["ms_per_token"], float)     # two timings' difference: noise on a busy CPU


def test_repeats_take_the_median_of_fresh_engines(tmp_path):
    res = e2e.main(["--model", "tiny", "--device", "cpu", "--format", "bf16", "--layers", "3", "--batch", "2",
                    "--context", "64", "--prefill", "", "--steps", "2", "--hf", "off", "--repeats", "3",
                    "--out", str(tmp_path)])
    assert not res["errors"] and len(res["decode"]) == 1
    for case in res["decode"]:
        assert len(case["step_ms_runs"]) == 3 and case["step_ms"] == sorted(case["step_ms_runs"])[1]


def test_async_scheduling_reaches_every_decode_engine(tmp_path, monkeypatch):
    """--no-async-scheduling builds each decode case's engine without it (the engine's default, which e2e keeps
    otherwise: the steps in a row launch ahead)."""
    flags = []

    def engine(*args, **kwargs):
        flags.append(kwargs.get("async_scheduling"))
        return Engine(*args, **kwargs)

    monkeypatch.setattr(e2e, "Engine", engine)
    res = e2e.main(["--model", "tiny", "--device", "cpu", "--format", "bf16", "--layers", "3", "--batch", "1,2",
                    "--context", "64", "--prefill", "", "--steps", "2", "--hf", "off", "--no-async-scheduling",
                    "--out", str(tmp_path)])
    assert not res["errors"] and len(res["decode"]) == 2 and res["async_scheduling"] is False
    assert flags == [False, False]
    assert all(case["step_ms_in_a_row"] > 0 for case in res["decode"])


def test_step_bytes_counts_weights_experts_and_cache():
    cfg = ModelConfig.tiny()
    model = dummy_model(cfg, "bf16", dtype=torch.float32)
    weights = e2e.module_bytes(model) - e2e.module_bytes(model.embed)
    everything = e2e.step_bytes(model, cfg, 10**6, 1, 4) - 10**6 * (cfg.hidden_size + 5 * cfg.head_dim) * 4
    assert abs(everything - weights) < 1e-6 * weights      # a huge batch touches every expert
    one = e2e.step_bytes(model, cfg, 1, 1024, 4)
    assert one < e2e.step_bytes(model, cfg, 2, 1024, 4) < weights
    # one more CSA entry per 4 tokens in two CSA layers (indexer key + the entry while under index_topk) and one
    # HCA entry per 128 tokens: 4 * 128 more tokens add 2 * 128 * (32 + 64) + 4 * 64 elements of 4 bytes
    grown = e2e.step_bytes(model, cfg, 1, 1024 + 512, 4) - one
    picks = 2 * (min(cfg.index_topk, 384) - min(cfg.index_topk, 256)) * cfg.head_dim
    assert grown == 4 * (2 * 128 * cfg.index_head_dim + picks + 4 * cfg.head_dim)
    # the fp8 cache: a key is its codes and a 4-byte scale, an entry a packed row (88 bytes at 64 channels)
    fp8 = e2e.step_bytes(model, cfg, 1, 1024 + 512, 4, "fp8") - e2e.step_bytes(model, cfg, 1, 1024, 4, "fp8")
    assert fp8 == 2 * 128 * (cfg.index_head_dim + 4) + (picks // cfg.head_dim + 4) * 88
    keys_only = e2e.step_bytes(model, cfg, 1, 1024 + 512, 4, "fp8-indexer") - \
        e2e.step_bytes(model, cfg, 1, 1024, 4, "fp8-indexer")
    assert keys_only == 2 * 128 * (cfg.index_head_dim + 4) + 4 * (picks + 4 * cfg.head_dim)


def test_toy_run_on_two_ranks(tmp_path):
    """--tensor-parallel-size 2 on gloo processes: one parallel LLM per layer count runs every case (sequences
    admitted and aborted in turn on its one cache) and the prefills."""
    res = e2e.main(["--toy", "--tensor-parallel-size", "2", "--format", "bf16", "--hf", "off", "--out", str(tmp_path)])
    assert not res["errors"], res["errors"]
    assert [(c["layers"], c["batch"], c["context"]) for c in res["decode"]] == [
        (layers, batch, context) for layers in (3, 5) for batch in (1, 2) for context in (64, 160)]
    assert all(c["step_ms"] > 0 and c["tensor_parallel_size"] == 2 for c in res["decode"])
    assert len(res["per_layer"]) == 4 and len(res["prefill"]) == 2


def test_one_rank_of_a_layout_runs_alone_on_its_share(tmp_path):
    """--one-rank-of 2 (the one-GPU dry run of a TP2 layout): rank 0's part alone, its collectives absent, runs the
    decode case and the prefill; the bytes its step reads are its share, below the whole model's; a layout the model
    cannot be split into is recorded as an error naming the tensor, not raised."""
    common = ["--model", "tiny", "--device", "cpu", "--layers", "3", "--batch", "2", "--context", "64",
              "--prefill", "96", "--chunk", "32", "--steps", "2", "--hf", "off"]
    whole = e2e.main([*common, "--format", "bf16", "--out", str(tmp_path / "whole")])
    rank = e2e.main([*common, "--format", "bf16,nvfp4-experts", "--one-rank-of", "2", "--out", str(tmp_path / "rank")])
    assert not whole["errors"] and rank["one_rank_of"] == 2
    assert [c["format"] for c in rank["decode"]] == ["bf16"] and rank["prefill"][0]["tokens_per_s"] > 0
    assert rank["decode"][0]["step_bytes"] < whole["decode"][0]["step_bytes"]
    errors = rank["errors"]
    assert len(errors) == 1 and "wo_a.scale" in errors[0] and "tensor_parallel_size" in errors[0]
    assert "rank 0 of 2 alone" in e2e.table(rank)


def test_absent_peers_keep_the_partial_and_fill_the_vocabulary():
    comm = e2e.AbsentPeers()
    x = torch.arange(12.0).view(2, 6)
    assert comm.all_reduce(x) is x
    out = comm.gather_last(x[:, :4], [4, 4, 3])
    assert out.shape == (2, 11) and torch.equal(out[:, :4], x[:, :4])


def test_per_layer_figures_from_the_fewest_and_most_layers():
    cases = {(4, 1, 8192, "graphs"): dict(step_ms=1.0, gpu_us=800.0), (8, 1, 8192, "graphs"): dict(step_ms=2.0,
                                                                                                  gpu_us=1600.0),
             (4, 64, 8192, "graphs"): dict(step_ms=3.0), (8, 64, 8192, "graphs"): dict(step_ms=5.0, gpu_us=1.0),
             (8, 256, 8192, "graphs"): dict(step_ms=9.0)}                  # no 4-layer case: no figure
    rows = e2e.per_layer("nvfp4-experts", cases, [4, 8])
    assert rows == [dict(format="nvfp4-experts", batch=1, context=8192, mode="graphs", us_per_layer=250.0,
                         kernel_us_per_layer=200.0),
                    dict(format="nvfp4-experts", batch=64, context=8192, mode="graphs", us_per_layer=500.0)]
    cases[(4, 1, 8192, "graphs")]["kernels_all"] = {"gemv": [400.0, 24], "topk": [20.0, 1], "head": [300.0, 1]}
    cases[(8, 1, 8192, "graphs")]["kernels_all"] = {"gemv": [800.0, 48], "topk": [60.0, 3], "head": [300.0, 1],
                                                    "combine": [8.0, 2]}
    by_kernel = e2e.per_layer("nvfp4-experts", cases, [4, 8])[0]["kernels_per_layer"]
    assert by_kernel == [dict(name="gemv", us=100.0, count=6.0), dict(name="topk", us=10.0, count=0.5),
                         dict(name="combine", us=2.0, count=0.5), dict(name="head", us=0.0, count=0.0)]
    cases[(4, 1, 8192, "graphs")] |= dict(idle_us=40.0, idle_before_all={"gemv": [30.0, 20], "head": [10.0, 1]})
    cases[(8, 1, 8192, "graphs")] |= dict(idle_us=80.0, idle_before_all={"gemv": [66.0, 40], "head": [10.0, 1],
                                                                          "topk": [4.0, 2]})
    row = e2e.per_layer("nvfp4-experts", cases, [4, 8])[0]
    assert row["idle_us_per_layer"] == 10.0
    assert row["idle_before_per_layer"] == [dict(name="gemv", us=9.0, count=5.0), dict(name="topk", us=1.0, count=0.5),
                                            dict(name="head", us=0.0, count=0.0)]
