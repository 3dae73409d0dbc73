"""dsv4.load + logits against transformers' DeepseekV4ForCausalLM, for every dialect x format dsv4 writes.

The tiny model has all three layer types (S, S, CSA, HCA, CSA + an MTP block), hash and biased MoE layers,
non-zero sinks / ape / mHC base and scale / gate biases, and w1/w3 large enough to hit the SwiGLU clamp.
Sequences of 290 tokens (batch 2) pass 2 x 128, so two HCA entries appear and the indexer selects from 72
CSA entries. fp32 logits must agree to a relative error (max |diff| / max |ref|) below 1e-4.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_fixtures
import dsv4
from dsv4.checkpoint.audit import audit
from dsv4.checkpoint.writer import FORMATS, NAMINGS
from dsv4.config import ModelConfig
from dsv4.kernels import Ops
from oracle import hf_logits, oracle_model, rel_err

pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, ModelConfig.tiny().vocab_size, (2, 290), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tiny():
    """make-tiny checkpoints (seed 0, several shards each), shared with the checkpoint tests."""
    return ckpt_fixtures.tiny


@pytest.fixture(scope="module")
def oracle(tiny, tmp_path_factory):
    """transformers on the exact weights of each format (the same for every naming of it)."""
    scratch = tmp_path_factory.mktemp("oracle")
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            cache[fmt] = oracle_model(tiny(fmt), fmt, scratch)
        return cache[fmt]
    return get


@pytest.fixture(scope="module")
def reference(oracle, ids):
    cache = {}

    def get(fmt: str) -> torch.Tensor:
        if fmt not in cache:
            cache[fmt] = hf_logits(oracle(fmt), ids)
        return cache[fmt]
    return get


@pytest.mark.parametrize("naming", NAMINGS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_transformers(fmt, naming, tiny, reference, ids):
    model = dsv4.load(tiny(fmt, naming))
    logits = model.logits(ids)
    assert logits.shape == (*ids.shape, model.config.vocab_size) and logits.dtype == torch.float32
    err = rel_err(logits, reference(fmt))
    print(f"\n{fmt:>14} {naming:>8}: max rel err {err:.2e}")
    assert err < TOL
    # Every buffer was filled, the MTP block is held, and the tiny weights have no zero or NaN parameter.
    assert not any(t.is_meta for t in model.state_dict().values())
    assert len(model.mtp) == 1 and model.mtp[0].e_proj.qweight().dequantize().abs().sum() > 0
    assert audit(model) == []


@pytest.mark.parametrize("length", [1, 3, 4, 127, 128, 129, 256])
def test_short_and_window_boundary_lengths(length, tiny, oracle, ids):
    """No compressed entry yet, the first CSA entry, and the window / HCA boundaries at 128 and 256."""
    model = dsv4.load(tiny("official"))
    prefix = ids[:1, :length]
    assert rel_err(model.logits(prefix), hf_logits(oracle("official"), prefix)) < TOL


@pytest.mark.parametrize("written_by", ["save_pretrained", "state_dict"])
def test_checkpoints_written_by_transformers_load(written_by, reference, ids):
    """What transformers itself writes: `save_pretrained` (hf-saved) and its `state_dict()` under module names
    (hf-stacked: gate_up_proj stacked). Neither has the MTP block."""
    path = ckpt_fixtures.hf_saved() if written_by == "save_pretrained" else ckpt_fixtures.hf_stacked()
    model = dsv4.load(path)
    err = rel_err(model.logits(ids), reference("bf16"))
    print(f"\n  transformers {written_by}: max rel err {err:.2e}")
    assert err < TOL
    assert len(model.mtp) == 0 and [f.problem for f in audit(model)] == ["no MTP block"]


def test_w1_w3_with_different_weight_scale_2(tiny, ids, tmp_path):
    """NVFP4 experts whose w3 global scale differs from w1's: each stacked shard keeps its own."""
    src, dst = tiny("nvfp4-experts"), tmp_path / "ckpt"
    dst.mkdir()
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    for key in [k for k in tensors if k.endswith(".w3.weight_scale_2")]:
        tensors[key] = tensors[key] * 4
    save_file(tensors, str(dst / "model.safetensors"))
    for f in ("config.json", "hf_quant_config.json"):
        shutil.copy(src / f, dst)
    model = dsv4.load(dst)
    w13 = model.layers[2].ffn.experts.w13
    assert torch.equal(w13.weight_scale_2[:, 1], 4 * w13.weight_scale_2[:, 0])
    err = rel_err(model.logits(ids), hf_logits(oracle_model(dst, "nvfp4-experts", tmp_path), ids))
    print(f"\n  nvfp4-experts, w3 scale_2 = 4 x w1's: max rel err {err:.2e}")
    assert err < TOL


def test_bf16_compute_stays_close(tiny, reference, ids):
    model = dsv4.load(tiny("official"), dtype=torch.bfloat16)
    assert model.layers[0].attn.attn_sink.dtype == model.layers[0].attn_norm.weight.dtype == torch.float32
    assert model.embed.weight.dtype == model.layers[2].attn.compressor.wkv.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn                # stored formats stay
    assert model.layers[0].ffn.experts.w13.weight.dtype == torch.uint8
    assert model.layers[0].ffn.experts.w13.scale.dtype == torch.float8_e8m0fnu
    logits, ref = model.logits(ids), reference("official")
    assert logits.dtype == torch.bfloat16
    # bf16 noise flips a few discrete choices (routing, indexer picks) at some positions, so the maximum is
    # large (transformers in bf16 shows the same, ~0.4 here); the typical position must stay close.
    per_position = (logits.float() - ref).abs().amax(-1) / ref.abs().max()
    print(f"\n  official, bf16 compute: median rel err per position {per_position.median():.2e}")
    assert per_position.median() < 0.02


def test_w4a4_option_applies_to_every_nvfp4_layer_and_only_those(tiny, ids):
    from dsv4.model import QLinear

    exact = dsv4.load(tiny("nvfp4"))
    emulated = dsv4.load(tiny("nvfp4"), ops=Ops.reference(w4a4=True))
    layers = {n: m for n, m in emulated.named_modules() if isinstance(m, QLinear)}
    assert {n for n, m in layers.items() if m.w4a4} == {n for n, m in layers.items() if m.format.fmt == "nvfp4"}
    assert not any(m.w4a4 for m in exact.modules() if isinstance(m, QLinear))
    a, b = exact.logits(ids), emulated.logits(ids)
    assert bool(torch.isfinite(b).all()) and rel_err(b, a) > 1e-3   # FP4 activations really change the numerics


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process memory map (Linux)")
def test_unstacked_tensors_stay_in_the_mapped_shard(tiny):
    """On CPU, a tensor whose stored dtype is the model's is used in place: no copy of the shard's bytes."""
    model = dsv4.load(tiny("bf16"), dtype=torch.bfloat16)
    shards = tuple(str(f) for f in tiny("bf16").glob("*.safetensors"))
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(shards):
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            mapped.append((lo, hi))

    def in_shard(t):
        return any(lo <= t.untyped_storage().data_ptr() < hi for lo, hi in mapped)

    assert in_shard(model.embed.weight) and in_shard(model.layers[1].attn.wq_b.weight)
    assert not in_shard(model.layers[1].ffn.experts.w13.weight)     # stacked: one buffer, each piece copied once
