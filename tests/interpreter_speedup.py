"""Speed-ups of Triton's CPU interpreter for the suite (tests only); each answers exactly as Triton's own path.

A kernel launch under TRITON_INTERPRET=1 swaps every builtin of `triton.language` for an interpreted one, runs
the grid and swaps them back. Triton 3.9 also repeats that whole patch (an `inspect.getmembers` walk over the
language modules) on every call of a nested `@triton.jit` helper, even though the launch around it has already
done it; our kernels call helpers per unit and per K step, so the walk repeats hundreds of times a launch.
`install` makes a nested call skip the patch exactly when every language module the helper sees is already patched,
and otherwise keeps Triton's own path: the helper runs the same code on the same patched language either way.

`install` also memoizes two things the interpreter rebuilds for every operation of every program: the numpy dtype
that stores a Triton dtype (`_get_np_dtype` builds a 20-entry dict per call) and the block types of results
(`block_type(element, shape)`, which validates and formats the shape each time). Both are immutable values, equal
by name, so a shared instance answers as a fresh one (bench/results/round-50.md has what each speed-up saves).
"""

import inspect

import triton.language as tl


def install() -> bool:
    """Wrap `InterpretedFunction.__call__` (the nested-call path), memoize `_get_np_dtype` and the block types;
    False where this Triton's interpreter lacks the internals one of them relies on (that one changes nothing)."""
    return _skip_nested_repatching() & _memoize_np_dtypes() & _memoize_block_types()


def _memoize_np_dtypes() -> bool:
    """`_get_np_dtype` through a dict keyed by the scalar type: a block type maps as its element type does, which is
    the original's own rule, so every answer is the original's."""
    try:
        from triton.runtime import interpreter
        original = interpreter._get_np_dtype
    except (ImportError, AttributeError):
        return False
    if getattr(original, "memoized", False):
        return True
    block_type, pointer_type, np_dtypes = tl.block_type, tl.pointer_type, {}

    def get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, block_type) else tt_dtype
        if isinstance(key, pointer_type):   # unhashable; the original answers it first thing
            return original(key)
        np_dtype = np_dtypes.get(key)
        if np_dtype is None:
            np_dtype = np_dtypes[key] = original(key)
        return np_dtype

    get_np_dtype.memoized, get_np_dtype.original = True, original
    interpreter._get_np_dtype = get_np_dtype
    return True


def _memoize_block_types() -> bool:
    """The interpreter builder's `get_block_ty` and `block_type.with_element_ty` through a dict keyed by the element
    type's class and name and the shape, where the shape is plain ints (else the original path). A block type keeps
    its shape as a `tl.tuple` (Triton's own class, not Python's), as most callers pass it."""
    try:
        from triton.runtime import interpreter
        original_get = interpreter.InterpreterBuilder.get_block_ty
        block_type, tl_tuple = tl.core.block_type, tl.core.tuple
        original_with = block_type.with_element_ty
    except (ImportError, AttributeError):
        return False
    if getattr(original_get, "memoized", False):
        return True
    memo = {}

    def block_of(element, shape: tuple):
        key = (type(element), element.name, shape)
        ty = memo.get(key)
        if ty is None:
            ty = memo[key] = block_type(element, list(shape))
        return ty

    def int_dims(shape):
        dims = shape.values if type(shape) is tl_tuple else shape
        return tuple(dims) if type(dims) in (list, tuple) and all(type(s) is int for s in dims) else None

    def get_block_ty(self, dtype, shape):
        dims = int_dims(shape)
        return original_get(self, dtype, shape) if dims is None else block_of(dtype, dims)

    def with_element_ty(self, scalar_ty):
        dims = int_dims(self.shape)
        return original_with(self, scalar_ty) if dims is None else block_of(scalar_ty, dims)

    get_block_ty.memoized = True
    interpreter.InterpreterBuilder.get_block_ty = get_block_ty
    block_type.with_element_ty = with_element_ty
    return True


def original_np_dtype_map():
    """The interpreter's own `_get_np_dtype` (the test compares the memoized map with it)."""
    from triton.runtime import interpreter
    return getattr(interpreter._get_np_dtype, "original", interpreter._get_np_dtype)


def _skip_nested_repatching() -> bool:
    try:
        from triton.runtime import interpreter
        original = interpreter.InterpretedFunction.__call__
        rewrite, error = interpreter.InterpretedFunction.rewrite, interpreter.InterpreterError
        is_builtin = tl.core.is_builtin
    except (ImportError, AttributeError):
        return False
    if getattr(original, "skips_repatching", False):
        return True
    langs_of: dict = {}   # helper function -> the language modules in its globals (what Triton would patch)

    def call(self, *args, **kwargs):
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = [v for v in self.fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (tl, tl.core)]
        # patched <=> tl.load is the interpreter's wrapper, not the builtin
        if not langs or any(is_builtin(lang.load) for lang in langs):
            return original(self, *args, **kwargs)
        fn = rewrite(self)
        try:
            return fn(*args, **kwargs)
        except Exception as e:   # as Triton's own nested call reports it
            raise error(repr(e)) from e

    call.skips_repatching = True
    interpreter.InterpretedFunction.__call__ = call
    return True
