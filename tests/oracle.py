"""The independent oracle: transformers 5.23 `DeepseekV4ForCausalLM`, fp32, eager, on CPU.

transformers reads DeepSeek-named checkpoints itself (its conversion mapping is an independent name
mapping). For the `official` format it also dequantizes by itself (`FineGrainedFP8Config(dequantize=True)`:
FP8 128x128 blocks and MXFP4 experts). For NVFP4 checkpoints the weights are dequantized here with
`dsv4.formats` (checked bit-for-bit against ModelOpt in tests/test_formats_nvfp4.py), written as fp32
safetensors under DeepSeek names, and loaded by transformers from there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4.checkpoint.canonical import CANONICAL_LEAVES, open_checkpoint

logging.getLogger("transformers").setLevel(logging.ERROR)


def hf_from_pretrained(path: Path, dequantize_fp8: bool = False):
    import transformers

    kwargs = {}
    if dequantize_fp8:
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                      output_loading_info=True, **kwargs)
    # transformers initialises what it does not find: an oracle with invented weights would be no oracle.
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # The FP8 dequantizer emits bf16; E4M3 or E2M1 values times a power of two are exact in bf16 and in fp32.
    return model.float().eval()


def dequantized_copy(src: Path, dst: Path) -> Path:
    """Write every tensor of checkpoint `src` exactly dequantized to fp32 under DeepSeek names in `dst`."""
    ckpt = open_checkpoint(src)
    out = {}
    for name, t in ckpt.tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in ckpt.formats and leaf in CANONICAL_LEAVES:
            if leaf == "weight":
                out[name] = ckpt.qweight(module).dequantize(torch.float32)
        else:
            value = t.load()
            out[name] = value.float() if value.is_floating_point() else value
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"))
    config = ckpt.config.to_dict()
    config.pop("quantization_config", None)
    config["expert_dtype"] = None
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def oracle_model(deepseek_ckpt: Path, fmt: str, scratch: Path):
    """transformers on the exact weights of a DeepSeek-named checkpoint of format `fmt`."""
    if fmt == "bf16":
        return hf_from_pretrained(deepseek_ckpt)
    if fmt == "official":
        return hf_from_pretrained(deepseek_ckpt, dequantize_fp8=True)
    return hf_from_pretrained(dequantized_copy(deepseek_ckpt, scratch / f"{fmt}-dequantized"))


@torch.inference_mode()
def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids).logits


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
