"""Shared pieces of the kernel tests: strict Triton ops (a reference fallback fails the test) and the error metric."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from dsv4.formats import QWeight, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from dsv4.kernels import Ops, refuse_fallback as refuse  # noqa: F401  (for tests that call a kernel directly)


def strict_ops() -> Ops:
    """The Triton ops with every reference fallback replaced by a failure: a kernel test must run the kernel."""
    return Ops.triton(strict=True)


def rel_err(y: torch.Tensor, r: torch.Tensor) -> float:
    return ((y.double() - r.double()).norm() / r.double().norm()).item()


def stacked_weight(fmt: str, n: int, k: int, lead: tuple = (), scale: float = 0.05, spread: str = "row") -> QWeight:
    """A random QWeight [*lead, n, k] whose shards each carry their own scales. `spread`: magnitudes differ per
    row ("row") or per shard ("shard"). fmt: nvfp4, mxfp4, fp8 (UE8M0 scales) or fp8-f32 (fp32 scales)."""
    spread_shape = (*lead, n, 1) if spread == "row" else (*lead, 1, 1)
    w = torch.randn(*lead, n, k) * scale * torch.exp(0.5 * torch.randn(spread_shape))
    if fmt == "nvfp4":
        parts = [quantize_nvfp4(wi) for wi in w.reshape(-1, n, k)]
        q = torch.stack([p[0] for p in parts]).reshape(*lead, n, k // 2)
        s = torch.stack([p[1] for p in parts]).reshape(*lead, n, k // 16)
        s2 = torch.stack([p[2] for p in parts]).reshape(lead)
        return QWeight("nvfp4", q, s, s2)
    if fmt == "mxfp4":
        return QWeight("mxfp4", *quantize_mxfp4(w))
    if fmt == "fp8":
        return QWeight("fp8", *quantize_fp8_block(w))
    if fmt == "fp8-f32":
        return QWeight("fp8", *quantize_fp8_block(w, torch.float32))
    raise ValueError(f"unknown test weight format {fmt!r}")


def compile_in_subprocess(script: str, cases) -> dict:
    """Run a compile `script` (python -c) for the GPU without one: a subprocess at the repository root with
    TRITON_INTERPRET unset and json(cases) as argv[1]; returns the JSON it prints after "RESULT "."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          env=env, cwd=root, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, f"sm_90 compile failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])
