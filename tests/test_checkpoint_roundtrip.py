"""read -> convert -> read, dialect x format: the same canonical tensors come back, bit-exact where the path
is lossless and within the format's rounding error where it quantizes.

Oracles: transformers 5.23 (its save_pretrained / state_dict give the hf-saved and hf-stacked sources; its
from_pretrained loads our bf16 hf output and, with FineGrainedFP8Config(dequantize=True), our official
output), ModelOpt 0.47 (dequantizes our NVFP4 bytes), and the random reference tensors themselves.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ckpt_fixtures as fx
from dsv4.checkpoint import names
from dsv4.checkpoint.canonical import Checkpoint, in_memory_checkpoint, open_checkpoint
from dsv4.checkpoint.convert import convert_checkpoint
from dsv4.checkpoint.spec import ROUTED, model_specs
from dsv4.checkpoint.writer import FORMATS, plan
from dsv4.formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, QWeight


# ------------------------------------------------------------------------------------------ helpers
def values(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Every logical tensor (linears dequantized exactly) in fp32, by canonical name (MTP when present)."""
    out = {}
    for s in model_specs(ckpt.config, include_mtp=ckpt.has_mtp()):
        if s.is_linear:
            out[s.name] = ckpt.qweight(s.module).dequantize(torch.float32)
        else:
            out[s.name] = ckpt.tensors[s.name].load().to(torch.float64 if s.dtype == torch.int64 else torch.float32)
    return out


def error_bound(q: QWeight, ref: torch.Tensor) -> torch.Tensor:
    """Largest rounding error each element may have in its format (from the stored scales)."""
    x = ref.abs().float()
    if q.fmt == "fp8":
        # E4M3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal step 2^-9 of the tile scale
        tile = q.scale.float().repeat_interleave(FP8_BLOCK, 0)[: x.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : x.shape[1]]
        return x * 2.0**-4 + tile * 2.0**-10
    if q.fmt in ("mxfp4", "nvfp4"):
        # E2M1 spacing is a quarter of the magnitude above 1 (half-gap 0.25 * |v|), 0.5 below: plus, for NVFP4,
        # the E4M3 rounding of the block scale may push a block's largest element up to 6 * (1 + 2^-4) -> 6.
        block = MXFP4_BLOCK if q.fmt == "mxfp4" else NVFP4_BLOCK
        unit = q.scale.float() * (1.0 if q.scale_2 is None else q.scale_2.float())
        unit = unit.repeat_interleave(block, 1)
        return 0.25 * torch.maximum(x, unit) + (0.4 * unit if q.fmt == "nvfp4" else 0)
    return torch.zeros_like(x)


def assert_same_model(got: Checkpoint, ref: dict[str, torch.Tensor]) -> dict[str, int]:
    """Compare `got` with reference values; quantized linears within their format's error. Returns formats seen."""
    seen: dict[str, int] = {}
    specs = model_specs(got.config, include_mtp=got.has_mtp())
    assert {s.name for s in specs} <= set(got.tensors) | {f"{s.module}.weight" for s in specs}
    for s in specs:
        want = ref[s.name].float() if s.dtype != torch.int64 else ref[s.name]
        if not s.is_linear:
            t = got.tensors[s.name].load()
            assert torch.equal(t.to(want.dtype), want), s.name
            continue
        q = got.qweight(s.module)
        seen[q.fmt] = seen.get(q.fmt, 0) + 1
        deq = q.dequantize(torch.float32)
        if q.fmt == "dense":
            assert torch.equal(deq, want), s.name
        else:
            err = (deq - want).abs()
            assert (err <= error_bound(q, want) + 1e-12).all(), (s.name, q.fmt, float(err.max()))
    return seen


def stored(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def hf_experts_bf16() -> Path:
    """The tiny reference under per-expert transformers module names, bf16 (ModelOpt's unquantized export)."""
    out = fx.workdir() / "hf-experts-bf16"
    if not out.exists():
        out.mkdir()
        tensors = {names.dialect_key(n, "hf-experts"): t.contiguous() for n, t in fx.reference().items()}
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text((fx.tiny() / "config.json").read_text())
    return out


SOURCES = {
    "deepseek": lambda: fx.tiny(),
    "hf-saved": fx.hf_saved,          # written by transformers' save_pretrained (fp32, no MTP)
    "hf-stacked": fx.hf_stacked,      # transformers' state_dict (fp32, stacked experts, no MTP)
    "hf-experts": hf_experts_bf16,
}


# ------------------------------------------------------------------------------------------ dialect x format
@pytest.mark.parametrize("dialect", list(SOURCES))
def test_sources_read_back_as_the_reference(dialect):
    ckpt = open_checkpoint(SOURCES[dialect]())
    assert ckpt.dialect == dialect
    assert ckpt.has_mtp() == (dialect in ("deepseek", "hf-experts"))
    assert set(ckpt.formats.values()) == {"dense"}
    assert_same_model(ckpt, fx.reference())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dialect", list(SOURCES))
def test_convert_every_dialect_to_every_format(dialect, fmt):
    naming = "hf" if dialect == "hf-experts" else "deepseek"
    out = fx.fresh_dir(f"{dialect}-{fmt}")
    report = convert_checkpoint(SOURCES[dialect](), out, fmt=fmt, naming=naming, shard_bytes=fx.SMALL_SHARD)
    got = open_checkpoint(out)
    assert got.dialect == ("deepseek" if naming == "deepseek" else ("hf-saved" if fmt == "bf16" else "hf-experts"))
    assert got.config == fx.tiny_config()
    assert len(set(got.sources.values())) == report.shards > 1
    want_keys = {t.key for u in plan(got.config, fmt, naming, include_mtp=got.has_mtp()) for t in u.tensors}
    assert set(got.sources) == want_keys
    seen = assert_same_model(got, fx.reference())
    expected = {"bf16": {"dense"}, "official": {"dense", "fp8", "mxfp4"}, "nvfp4-experts": {"dense", "fp8", "nvfp4"},
                "nvfp4": {"dense", "nvfp4"}}[fmt]
    if fmt == "nvfp4-experts" and got.has_mtp():
        expected |= {"mxfp4"}  # the MTP block's experts stay official, as ModelOpt's V4 recipe leaves them
    assert set(seen) == expected


def test_hf_naming_bf16_is_what_transformers_loads():
    from transformers import DeepseekV4ForCausalLM

    out = fx.tiny("bf16", "hf")
    model, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    ours = fx.hf_model().state_dict()  # loaded by transformers from the DeepSeek-named bf16 checkpoint
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert any(k.startswith("mtp.") for k in stored(out))  # transformers ignores it; we keep it


def test_official_output_loads_in_transformers_with_equal_weights():
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    out = fx.tiny("official")
    qc = FineGrainedFP8Config(dequantize=True, weight_block_size=[128, 128], scale_fmt="ue8m0", expert_dtype="fp4")
    model, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, quantization_config=qc,
                                                        output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    hf = model.state_dict()
    ours = values(open_checkpoint(out))
    cfg = fx.tiny_config()
    checked = 0
    for name, v in ours.items():
        if name.startswith("mtp."):
            continue
        key = names.dialect_key(name, "hf-stacked")
        t = hf[key].float()
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            parts = name.split(".")
            e, w = int(parts[4]), parts[5]
            t = t[e] if w == "w2" else t[e].chunk(2)[0 if w == "w1" else 1]
        assert torch.equal(t, v.float()), name
        checked += 1
    assert checked == len(model_specs(cfg, include_mtp=False))
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["quantization_config"]["quant_method"] == "fp8" and cfg_json["expert_dtype"] == "fp4"


# ------------------------------------------------------------------------------------------ lossless paths
def test_official_to_bf16_is_exact():
    official = open_checkpoint(fx.tiny("official"))
    out = fx.fresh_dir("official-bf16")
    convert_checkpoint(official, out, fmt="bf16")
    want = values(official)
    got = values(open_checkpoint(out))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_official_to_nvfp4_experts_reblocks_exactly_and_back():
    official_dir = fx.tiny("official")
    official = open_checkpoint(official_dir)
    nv = fx.fresh_dir("official-nvfp4x")
    report = convert_checkpoint(official, nv, fmt="nvfp4-experts")
    cfg = official.config
    n_routed, n_mtp_routed = routed_experts(cfg)
    assert report.paths["nvfp4 reblocked"] == n_routed and report.paths["mxfp4 copied"] == n_mtp_routed > 0
    assert report.paths["fp8 copied"] > 0 and not any("quantized" in p for p in report.paths)
    got = open_checkpoint(nv)
    assert values(got).keys() == values(official).keys()
    for name, v in values(official).items():
        assert torch.equal(values_one(got, name), v), name
    # w1 and w3 of an expert share weight_scale_2 (one alpha for the fused GEMM1)
    t = stored(nv)
    assert torch.equal(t["layers.2.ffn.experts.3.w1.weight_scale_2"], t["layers.2.ffn.experts.3.w3.weight_scale_2"])
    # and back: the same values (not always the same bytes: a block whose largest code rounded down to 3 is
    # re-encoded with half the scale and codes 6)
    back = fx.fresh_dir("nvfp4x-official")
    report = convert_checkpoint(nv, back, fmt="official")
    assert report.paths["mxfp4 requantized"] == n_routed and report.paths["mxfp4 copied"] == n_mtp_routed
    again = values(open_checkpoint(back))
    for name, v in values(official).items():
        assert torch.equal(again[name], v), name


def routed_experts(cfg) -> tuple[int, int]:
    """(routed expert linears of the main layers, of the MTP block): nvfp4-experts changes only the first."""
    routed = [s.name for s in model_specs(cfg) if s.role == ROUTED]
    mtp = sum(1 for n in routed if n.startswith("mtp."))
    return len(routed) - mtp, mtp


def values_one(ckpt: Checkpoint, name: str) -> torch.Tensor:
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    if module in ckpt.formats:
        return ckpt.qweight(module).dequantize(torch.float32)
    return ckpt.tensors[name].load().to(torch.float64 if ckpt.tensors[name].dtype == torch.int64 else torch.float32)


def test_same_format_conversions_copy_bytes():
    for fmt in ("nvfp4", "official"):
        src = fx.tiny(fmt, "hf")
        out = fx.fresh_dir(f"{fmt}-copy")
        report = convert_checkpoint(src, out, fmt=fmt, naming="deepseek")
        assert all(p.endswith("copied") for p in report.paths), report.paths
        a, b = stored(src), stored(out)
        renamer = names.Renamer("hf-experts")
        for key, t in a.items():
            canonical = renamer.match(key).canonical()
            assert torch.equal(t.reshape(-1).view(torch.uint8), b[canonical].reshape(-1).view(torch.uint8)), key


def test_mxfp4_reblock_refused_falls_back_to_requantization():
    """A 32-block 2^-40 smaller than the rest cannot be re-blocked into E4M3 block scales exactly."""
    cfg = fx.tiny_config()
    tensors = dict(fx.reference())
    w1 = tensors["layers.2.ffn.experts.1.w1.weight"].clone()
    w1[0, :MXFP4_BLOCK] *= 2.0**-40
    tensors["layers.2.ffn.experts.1.w1.weight"] = w1
    official = fx.fresh_dir("zero-block-official")
    convert_checkpoint(in_memory_checkpoint(tensors, cfg, Path("<zero block>")), official, fmt="official")
    nv = fx.fresh_dir("zero-block-nvfp4")
    report = convert_checkpoint(official, nv, fmt="nvfp4-experts")
    n_routed, _ = routed_experts(cfg)
    assert report.paths["nvfp4 reblock-refused (requantized)"] == 2  # w1 and its w3 (shared k_max)
    assert report.paths["nvfp4 reblocked"] == n_routed - 2
    src, got = open_checkpoint(official), open_checkpoint(nv)
    for w in ("w1", "w3"):
        module = f"layers.2.ffn.experts.1.{w}"
        q, want = got.qweight(module), src.qweight(module).dequantize(torch.float32)
        assert ((q.dequantize(torch.float32) - want).abs() <= error_bound(q, want)).all()
    t = stored(nv)
    assert torch.equal(t["layers.2.ffn.experts.1.w1.weight_scale_2"], t["layers.2.ffn.experts.1.w3.weight_scale_2"])


# ------------------------------------------------------------------------------------------ storage variants
def test_packed_fp4_as_f4_u8_or_i8_and_scales_as_weight_scale_inv():
    """The same official checkpoint with packed weights re-typed F4 / U8 and FP8 scales renamed: same model."""
    src = fx.tiny("official")
    t = stored(src)
    want = values(open_checkpoint(src))
    for packed in (torch.float4_e2m1fn_x2, torch.uint8):
        variant = {}
        for k, v in t.items():
            if v.dtype == torch.int8:
                v = v.view(packed)
            if k.endswith(".scale") and ".experts." not in k:
                k = k[: -len("scale")] + "weight_scale_inv"
            variant[k] = v
        out = fx.fresh_dir(f"variant-{packed}")
        save_file(variant, out / "model.safetensors")
        (out / "config.json").write_text((src / "config.json").read_text())
        got = open_checkpoint(out)
        assert got.tensors["layers.2.ffn.experts.0.w1.weight"].dtype == torch.uint8
        assert got.tensors["layers.2.ffn.experts.0.w1.weight"].shape == (32, 32)
        for name, v in values(got).items():
            assert torch.equal(v, want[name]), name


def test_nvfp4_bytes_read_by_modelopt():
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    ckpt = open_checkpoint(fx.tiny("nvfp4"))
    checked = 0
    for module, fmt in ckpt.formats.items():
        if fmt != "nvfp4" or not module.startswith("layers.2."):
            continue
        q = ckpt.qweight(module)
        n, k = q.out_features, q.in_features
        theirs = NVFP4QTensor(torch.Size([n, k]), torch.float32, q.weight).dequantize(
            dtype=torch.float32, scale=q.scale, double_scale=q.scale_2, block_sizes={-1: NVFP4_BLOCK})
        # same values up to the order of the two scale multiplications (an ulp)
        torch.testing.assert_close(theirs, q.dequantize(torch.float32), rtol=2.0**-22, atol=0)
        assert float(q.input_scale) == 1.0  # calibration-free default
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("fmt", ["nvfp4-experts", "nvfp4"])
@pytest.mark.parametrize("naming", ["deepseek", "hf"])
def test_hf_quant_config_describes_the_nvfp4_layers(fmt, naming):
    out = fx.tiny(fmt, naming)
    quant = json.loads((out / "hf_quant_config.json").read_text())
    q = quant["quantization"]
    assert q["group_size"] == 16 and q["kv_cache_quant_algo"] is None and "exclude_modules" in q
    assert q["quant_algo"] == ("MIXED_PRECISION" if fmt == "nvfp4-experts" else "NVFP4")
    nvfp4 = {k.rpartition(".")[0] for k in stored(out) if k.endswith(".weight_scale")}
    linear_names = {s.name for s in model_specs(fx.tiny_config()) if s.is_linear}
    linear = {t.key.rpartition(".")[0] for u in plan(fx.tiny_config(), fmt, naming) for t in u.tensors
              if t.canonical in linear_names}
    assert nvfp4 < linear
    excluded = {m for m in linear if any(fnmatch.fnmatch(m, p) or fnmatch.fnmatch(m + ".weight", p)
                                         for p in q["exclude_modules"])}
    assert not nvfp4 & excluded
    if fmt == "nvfp4":
        assert linear - nvfp4 == excluded
        return
    # MIXED_PRECISION: `quantized_layers` names the NVFP4 expert groups; attention, shared experts, head and the
    # MTP block are excluded (routers, compressors and the rest are in neither list: config.json's FP8 / bf16).
    groups = set(q["quantized_layers"])
    assert {m.rsplit(".", 2)[0] for m in nvfp4} == groups
    assert len(groups) == fx.tiny_config().num_hidden_layers
    renamer = names.Renamer("deepseek" if naming == "deepseek" else "hf-experts")

    def kept_as_is(module: str) -> bool:
        c = renamer.match(module + ".weight").canonical()
        return c.startswith("mtp.") or ".attn." in c or ".shared_experts." in c or c == "head.weight"

    assert {m for m in linear if kept_as_is(m)} == excluded
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["quantization_config"]["moe_quant_algo"] == "NVFP4"
    assert cfg_json["quantization_config"]["quant_method"] == "fp8"
    assert cfg_json["quantization_config"]["ignore"] == q["exclude_modules"]
    assert cfg_json["quantization_config"]["quantized_layers"] == q["quantized_layers"]


def test_nvfp4_to_bf16_rounds_each_weight_once():
    src = open_checkpoint(fx.tiny("nvfp4"))
    out = fx.fresh_dir("nvfp4-bf16")
    report = convert_checkpoint(src, out, fmt="bf16")
    assert report.paths["bf16 dequantized"] == sum(1 for f in src.formats.values() if f == "nvfp4")
    got, want = values(open_checkpoint(out)), values(src)
    linear = {s.name for s in model_specs(src.config) if s.is_linear}
    for name in want:
        rounded = want[name].to(torch.bfloat16).float() if name in linear else want[name]
        assert torch.equal(got[name], rounded), name


def test_quantized_stacked_experts_read_like_per_expert_ones():
    """transformers' FP4 expert layout: gate_up_proj I8 [E, 2I, H/2] (w1 rows first) + gate_up_proj_scale_inv."""
    src_dir = fx.tiny("official")
    src = open_checkpoint(src_dir)
    cfg = src.config

    def load(name: str) -> torch.Tensor:
        t = src.tensors[name].load()
        return t.view(torch.int8) if t.dtype == torch.uint8 else t

    tensors = {names.dialect_key(n, "hf-stacked"): load(n) for n in src.tensors
               if not (n.startswith("layers.") and ".ffn.experts." in n)}
    for i in range(cfg.num_hidden_layers):
        for leaf, suffix in (("weight", ""), ("scale", "_scale_inv")):
            experts = range(cfg.n_routed_experts)
            p = f"layers.{i}.ffn.experts"
            tensors[f"model.layers.{i}.mlp.experts.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([load(f"{p}.{e}.w1.{leaf}"), load(f"{p}.{e}.w3.{leaf}")]) for e in experts])
            tensors[f"model.layers.{i}.mlp.experts.down_proj{suffix}"] = torch.stack(
                [load(f"{p}.{e}.w2.{leaf}") for e in experts])
    assert "model.layers.2.self_attn.q_a_proj.weight_scale_inv" in tensors
    out = fx.fresh_dir("stacked-official")
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text((src_dir / "config.json").read_text())
    got = open_checkpoint(out)
    assert got.dialect == "hf-stacked" and got.formats == src.formats
    piece = got.tensors["layers.3.ffn.experts.5.w3.scale"]
    assert piece.source == "model.layers.3.mlp.experts.gate_up_proj_scale_inv" and piece.shape == (32, 2)
    want = values(src)
    for name, v in values(got).items():
        assert torch.equal(v, want[name]), name
