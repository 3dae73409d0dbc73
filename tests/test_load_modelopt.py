"""ModelOpt's DeepSeek-V4 NVFP4 layout, as its recipe writes it: dsv4 loads it, `dsv4 convert --format nvfp4-experts`
writes the same, and a config declaring `quant_method: "modelopt"` over FP8-block linears is refused.

The recipe (NVIDIA's V4-Flash / V4-Pro NVFP4 builds) re-quantizes only the routed experts of the main layers to NVFP4
(U8 weight, E4M3 weight_scale per 16, F32 weight_scale_2 and input_scale) and leaves the rest as DeepSeek released
it: FP8 128x128 blocks, MXFP4 MTP experts. config.json keeps `quant_method: "fp8"`, adds `moe_quant_algo: "NVFP4"` and
copies hf_quant_config.json's MIXED_PRECISION manifest in. TensorRT-LLM read such a manifest as "attention excluded,
so unquantized" and built bf16 attention over FP8 tensors (NVIDIA/TensorRT-LLM#16196); dsv4 reads every linear from
its stored dtypes and scales and refuses a config that leaves FP8 blocks undeclared.
"""

from __future__ import annotations

import json

import pytest
import torch

import ckpt_fixtures as fx
import dsv4
from dsv4.checkpoint.canonical import open_checkpoint
from dsv4.checkpoint.convert import convert_checkpoint
from dsv4.checkpoint.errors import CheckpointError
from dsv4.checkpoint.inspect import inspect_checkpoint
from dsv4.checkpoint.reader import INDEX_NAME
from oracle import hf_logits, oracle_model, rel_err

# Written by NVIDIA/Model-Optimizer examples/deepseek/deepseek_v4/quantize_to_nvfp4.py (snapshot a2fbac7b,
# 2026-08-21; the file last changed in f335459d): `_rewrite_config_json` (json.dumps(cfg, indent=2, sort_keys=True)
# + "\n") and `_write_index_and_manifest` (json.dumps(_build_hf_quant_config(...), indent=2)), run on the tiny
# model's DeepSeek-style config.json (`dsv4 make-tiny --format official`) with the quantized routed-expert groups
# layers.0-4.ffn.experts.
MODELOPT_CONFIG_JSON = """{
  "architectures": [
    "DeepseekV4ForCausalLM"
  ],
  "bos_token_id": 0,
  "compress_ratios": [
    0,
    0,
    4,
    128,
    4,
    0
  ],
  "compress_rope_theta": 160000.0,
  "eos_token_id": 1,
  "expert_dtype": "fp4",
  "hc_eps": 1e-06,
  "hc_mult": 4,
  "hc_sinkhorn_iters": 20,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 64,
  "index_head_dim": 32,
  "index_n_heads": 2,
  "index_topk": 4,
  "max_position_embeddings": 4096,
  "model_type": "deepseek_v4",
  "moe_intermediate_size": 32,
  "n_routed_experts": 8,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 4,
  "num_experts_per_tok": 2,
  "num_hash_layers": 2,
  "num_hidden_layers": 5,
  "num_key_value_heads": 1,
  "num_nextn_predict_layers": 1,
  "o_groups": 2,
  "o_lora_rank": 16,
  "q_lora_rank": 32,
  "qk_rope_head_dim": 16,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "config_groups": {
      "group_0": {
        "input_activations": {
          "dynamic": false,
          "group_size": 16,
          "num_bits": 4,
          "type": "float"
        },
        "targets": [
          "Linear"
        ],
        "weights": {
          "dynamic": false,
          "group_size": 16,
          "num_bits": 4,
          "type": "float"
        }
      }
    },
    "fmt": "e4m3",
    "group_size": 16,
    "ignore": [
      "*.attn.*",
      "*.ffn.shared_experts.*",
      "head",
      "mtp.*"
    ],
    "kv_cache_quant_algo": null,
    "moe_quant_algo": "NVFP4",
    "producer": {
      "name": "modelopt",
      "version": "dsv4-nvfp4-experts"
    },
    "quant_algo": "MIXED_PRECISION",
    "quant_method": "fp8",
    "quantized_layers": {
      "layers.0.ffn.experts": {
        "group_size": 16,
        "quant_algo": "NVFP4"
      },
      "layers.1.ffn.experts": {
        "group_size": 16,
        "quant_algo": "NVFP4"
      },
      "layers.2.ffn.experts": {
        "group_size": 16,
        "quant_algo": "NVFP4"
      },
      "layers.3.ffn.experts": {
        "group_size": 16,
        "quant_algo": "NVFP4"
      },
      "layers.4.ffn.experts": {
        "group_size": 16,
        "quant_algo": "NVFP4"
      }
    },
    "scale_fmt": "ue8m0",
    "weight_block_size": [
      128,
      128
    ]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "type": "yarn"
  },
  "rope_theta": 10000.0,
  "routed_scaling_factor": 1.5,
  "scoring_func": "sqrtsoftplus",
  "sliding_window": 128,
  "swiglu_limit": 10.0,
  "tie_word_embeddings": false,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "vocab_size": 512
}
"""
MODELOPT_HF_QUANT_CONFIG_JSON = """{
  "producer": {
    "name": "modelopt",
    "version": "dsv4-nvfp4-experts"
  },
  "quantization": {
    "quant_algo": "MIXED_PRECISION",
    "kv_cache_quant_algo": null,
    "group_size": 16,
    "quantized_layers": {
      "layers.0.ffn.experts": {
        "quant_algo": "NVFP4",
        "group_size": 16
      },
      "layers.1.ffn.experts": {
        "quant_algo": "NVFP4",
        "group_size": 16
      },
      "layers.2.ffn.experts": {
        "quant_algo": "NVFP4",
        "group_size": 16
      },
      "layers.3.ffn.experts": {
        "quant_algo": "NVFP4",
        "group_size": 16
      },
      "layers.4.ffn.experts": {
        "quant_algo": "NVFP4",
        "group_size": 16
      }
    },
    "exclude_modules": [
      "*.attn.*",
      "*.ffn.shared_experts.*",
      "head",
      "mtp.*"
    ]
  }
}"""
# The quantization_config keys that declare the FP8 blocks (DeepSeek's) and the NVFP4 experts among them (the
# recipe's moe_quant_algo); a generic ModelOpt export (quant_method "modelopt") has none of them.
FP8_KEYS = ("activation_scheme", "fmt", "scale_fmt", "weight_block_size", "moe_quant_algo")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, fx.tiny_config().vocab_size, (2, 150), generator=torch.Generator().manual_seed(3))


def as_modelopt_writes_it(name: str, config_json: str = MODELOPT_CONFIG_JSON):
    """dsv4's tiny nvfp4-experts tensors under the recipe's config.json and hf_quant_config.json, byte for byte."""
    dst = fx.copy_checkpoint(fx.tiny("nvfp4-experts"), name)
    (dst / "config.json").write_bytes(config_json.encode())
    (dst / "hf_quant_config.json").write_bytes(MODELOPT_HF_QUANT_CONFIG_JSON.encode())
    return dst


def test_the_recipe_layout_loads_with_the_same_logits(ids, tmp_path):
    dst = as_modelopt_writes_it("modelopt")
    ckpt = open_checkpoint(dst)
    assert ckpt.config == fx.tiny_config() and ckpt.dialect == "deepseek"
    # the recipe's storage: NVFP4 (with input_scale) routed experts in the main layers, the rest as released
    fmt = ckpt.formats
    assert fmt["layers.3.ffn.experts.5.w2"] == "nvfp4" and "layers.3.ffn.experts.5.w2.input_scale" in ckpt.tensors
    assert fmt["layers.2.attn.wq_b"] == fmt["layers.2.ffn.shared_experts.w1"] == fmt["mtp.0.attn.wo_a"] == "fp8"
    assert fmt["mtp.0.ffn.experts.5.w2"] == "mxfp4"

    model = dsv4.load(dst)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn        # FP8 blocks, not bf16
    logits = model.logits(ids)
    assert torch.equal(logits, dsv4.load(fx.tiny("nvfp4-experts")).logits(ids))
    err = rel_err(logits, hf_logits(oracle_model(dst, "nvfp4-experts", tmp_path), ids))
    print(f"\n  ModelOpt's config files: max rel err {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize("naming", ["deepseek", "hf"])
def test_convert_writes_the_recipe_layout(naming):
    out = fx.fresh_dir(f"to-modelopt-{naming}")
    convert_checkpoint(fx.tiny("official"), out, fmt="nvfp4-experts", naming=naming)
    config, want_config = json.loads((out / "config.json").read_text()), json.loads(MODELOPT_CONFIG_JSON)
    quant = json.loads((out / "hf_quant_config.json").read_text())
    want_quant = json.loads(MODELOPT_HF_QUANT_CONFIG_JSON)
    qc, want_qc = config["quantization_config"], want_config["quantization_config"]
    # the one difference by design: the producer names the writer
    assert quant["producer"] == qc["producer"] and quant["producer"]["name"] == "dsv4"
    del quant["producer"], want_quant["producer"], qc["producer"], want_qc["producer"]
    if naming == "deepseek":
        assert quant == want_quant and config == want_config
        return
    # transformers names: the same manifest with module names translated (mtp.* keeps DeepSeek's names)
    layers = {f"model.layers.{i}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in range(5)}
    patterns = ["*.self_attn.*", "*.mlp.shared_experts.*", "lm_head", "mtp.*"]
    assert quant == {"quantization": dict(want_quant["quantization"], quantized_layers=layers,
                                          exclude_modules=patterns)}
    assert qc == dict(want_qc, quantized_layers=layers, ignore=patterns, expert_dtype="fp4")


def quant_method_modelopt(config: dict) -> None:
    """ModelOpt's generic export form: the manifest under quant_method "modelopt", no FP8 declaration."""
    qc = config["quantization_config"]
    for key in FP8_KEYS:
        del qc[key]
    qc["quant_method"] = "modelopt"


def no_quantization_config(config: dict) -> None:
    """Only hf_quant_config.json describes the quantization."""
    del config["quantization_config"]


@pytest.mark.parametrize("edit,declared", [(quant_method_modelopt, "'modelopt'"), (no_quantization_config, "None")])
def test_fp8_blocks_the_config_does_not_declare_are_refused(edit, declared):
    config = json.loads(MODELOPT_CONFIG_JSON)
    edit(config)
    dst = as_modelopt_writes_it(f"undeclared-{edit.__name__}", json.dumps(config, indent=2))
    shard = json.loads((dst / INDEX_NAME).read_text())["weight_map"]["layers.0.attn.wkv.weight"]
    want = (f"quantization_config.quant_method is {declared}, not 'fp8', but 'layers.0.attn.wkv.weight' in "
            f"{dst / shard} is stored as FP8 blocks with scales 'layers.0.attn.wkv.scale'")
    with pytest.raises(CheckpointError) as e:
        dsv4.load(dst)
    assert want in str(e.value)
    assert any(want in r for r in inspect_checkpoint(dst).refusals)
