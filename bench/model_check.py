"""Tiny-checkpoint logits: the model on CUDA in bf16 with the Triton kernels vs on CPU in fp32 with the reference.

    python bench/model_check.py --out DIR            # needs a CUDA device
    TRITON_INTERPRET=1 python bench/model_check.py --cpu-only   # the same comparison, Triton interpreted on CPU

For scale it also reports the CPU reference run in bf16 against the fp32 one: the error that bf16 alone costs.
`--wide` uses a wider tiny model (hidden, expert and q-LoRA widths 128) whose quantized layers are whole
64 x 64-byte tiles, so the loader stores them tile-major (`formats.tiling`); the check then also loads the model
row-major on the same device and requires identical logits. Writes DIR/model_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv4  # noqa: E402
from dsv4.checkpoint.tiny import make_tiny  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.kernels import Ops  # noqa: E402
from dsv4.model.linear import QLinear  # noqa: E402

WIDE = dict(hidden_size=128, moe_intermediate_size=128, q_lora_rank=128)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def check(path: Path, device: str, seq: int) -> dict:
    cpu = dsv4.load(path, device="cpu", dtype=torch.float32, ops=Ops.reference())
    vocab = cpu.cfg.vocab_size if hasattr(cpu, "cfg") else 512
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, seq), generator=gen)
    with torch.no_grad():
        want = cpu.logits(ids).float()
        del cpu
        ref16 = dsv4.load(path, device="cpu", dtype=torch.bfloat16, ops=Ops.reference())
        floor = rel(ref16.logits(ids).float(), want)
        del ref16
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = dsv4.load(path, device=device, dtype=dtype, ops=Ops.triton(), tile_weights=True)  # as on CUDA
        got = model.logits(ids.to(device)).float().cpu()
        tiled = sum(1 for m in model.modules() if isinstance(m, QLinear) and m.tiled)
        del model
        row_major = dsv4.load(path, device=device, dtype=dtype, ops=Ops.triton(), tile_weights=False)
        same = bool(torch.equal(row_major.logits(ids.to(device)).float().cpu(), got))
    return dict(device=device, dtype=str(dtype), seq=seq, rel_err=rel(got, want), bf16_reference_rel_err=floor,
                argmax_agree=float((got.argmax(-1) == want.argmax(-1)).float().mean()),
                finite=bool(torch.isfinite(got).all()), tiled_layers=tiled, row_major_logits_identical=same)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--formats", default="nvfp4,official")
    ap.add_argument("--seq", type=int, default=40)
    ap.add_argument("--wide", action="store_true", help="a model wide enough for tiled weights (see above)")
    args = ap.parse_args()
    device = "cpu" if args.cpu_only else "cuda"
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            try:
                path = Path(tmp) / fmt
                make_tiny(path, seed=0, fmt=fmt, cfg=ModelConfig.tiny(**WIDE) if args.wide else None)
                res[fmt] = check(path, device, args.seq)
            except Exception:
                res[fmt] = {"error": traceback.format_exc()[-1500:]}
            print(fmt, json.dumps(res[fmt])[:800], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_check.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
