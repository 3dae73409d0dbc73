"""fp32 weights times bf16 values on the tensor cores, to within fp32 rounding (`dot_pieces`).

A bf16 tensor-core product of a bf16 value and a bf16 weight is exact in fp32; an fp32 weight w is the exact sum of
three bf16 pieces: hi, the leading 8 significant bits of w (its fp32 bits masked), mid, the leading 8 of w - hi, and
lo = w - hi - mid, which has at most 8 left (each difference is exact in fp32). So x w = x hi + x mid + x lo with
every product exact, and only the sums round. The tensor cores' fp32 accumulation truncates; each call sums one
block of K (the caller's BK columns) into a zero sum, smallest pieces first, and the caller adds that block sum to its
running fp32 sum once: the truncation spans three block products, not the whole K, and the result is the fp32
product's within fp32 rounding (tests: the mHC mixing and the router against float64).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_pieces(x, w, DOT: tl.constexpr):
    """x [M, BK] holding bf16 values, w [BK, N] fp32 -> fp32 [M, N] = x @ w, from zero (see the module docstring).
    DOT: the products' operand dtype, bf16 (fp32 in the interpreter, whose bf16 tl.dot is wrong; the pieces and x
    are exact in either)."""
    hi = (w.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    rest = w - hi
    mid = (rest.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    xd = x.to(DOT)
    block = tl.dot(xd, (rest - mid).to(tl.bfloat16).to(DOT), input_precision="ieee")
    block = tl.dot(xd, mid.to(tl.bfloat16).to(DOT), block, input_precision="ieee")
    return tl.dot(xd, hi.to(tl.bfloat16).to(DOT), block, input_precision="ieee")
