"""tests/interpreter_speedup.py: nested `@triton.jit` calls skip re-patching the language and compute the same; the
memoized dtype map and block types answer as the interpreter's own."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import interpreter_speedup


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _quadruple_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(y_ptr + offs, _twice(_twice(tl.load(x_ptr + offs))))


def test_nested_calls_skip_the_patch_and_compute_the_same(monkeypatch):
    if not interpreter_speedup.install():   # installed by conftest; a second call keeps it
        pytest.skip("this Triton's interpreter lacks the internals the speed-up wraps: the suite runs without it")
    assert getattr(interpreter.InterpretedFunction.__call__, "skips_repatching", False)
    patches = []
    real = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patches.append(fn.__name__) or real(fn))
    x = torch.randn(3 * 8)
    y = torch.empty_like(x)
    _quadruple_kernel[(3,)](x, y, N=8)
    assert torch.equal(y, x * 4)
    # the launch patches once; Triton's own nested path would add one per _twice call (two per program)
    assert patches == ["_quadruple_kernel"]
    assert tl.core.is_builtin(tl.load)   # the launch restored the language afterwards


def test_the_memoized_dtype_map_answers_as_the_original():
    if not interpreter_speedup.install():
        pytest.skip("this Triton's interpreter lacks the internals the speed-up wraps: the suite runs without it")
    memoized = interpreter._get_np_dtype
    assert getattr(memoized, "memoized", False)
    original = interpreter_speedup.original_np_dtype_map()
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e4nv]
    for ty in scalars + [tl.pointer_type(t) for t in scalars[:4]]:
        for shaped in (ty, tl.block_type(ty, [4]), tl.block_type(ty, [2, 8])):
            for _ in range(2):     # the second answer comes from the memo
                assert memoized(shaped) == original(shaped), shaped
    assert memoized(tl.bfloat16).itemsize == 2 and memoized(tl.pointer_type(tl.float32)).itemsize == 8


def test_memoized_block_types_equal_fresh_ones():
    if not interpreter_speedup.install():
        pytest.skip("this Triton's interpreter lacks the internals the speed-up wraps: the suite runs without it")
    builder = interpreter.InterpreterBuilder()
    a = builder.get_block_ty(tl.float32, [4, 8])
    assert builder.get_block_ty(tl.float32, tl.core.tuple([4, 8])) is a           # shared, whichever tuple
    assert a == tl.block_type(tl.float32, [4, 8]) and a.element_ty == tl.float32 and list(a.shape) == [4, 8]
    assert builder.get_block_ty(tl.float32, [8, 4]) != a and builder.get_block_ty(tl.int32, [4, 8]) != a
    b = a.with_element_ty(tl.int32)
    assert b is builder.get_block_ty(tl.int32, [4, 8]) and b == tl.block_type(tl.int32, [4, 8])
    assert b.element_ty == tl.int32 and a.element_ty == tl.float32                 # a is left as it was
    p = builder.get_block_ty(tl.pointer_type(tl.float32), [4])
    assert p == tl.block_type(tl.pointer_type(tl.float32), [4]) and p.element_ty.is_ptr()
