"""Make Triton's CPU interpreter skip re-patching `triton.language` on nested `@triton.jit` calls (tests only).

A kernel launch under TRITON_INTERPRET=1 swaps every builtin of `triton.language` for an interpreted one, runs
the grid and swaps them back. Triton 3.9 also repeats that whole patch (an `inspect.getmembers` walk over the
language modules) on every call of a nested `@triton.jit` helper, even though the launch around it has already
done it; our kernels call helpers per unit and per K step, so that walk was about a third of the suite's time
(test_shared_expert_as_token_columns: 30 s -> 20 s per launch set). `install` makes a nested call skip the patch
exactly when every language module the helper sees is already patched, and otherwise keeps Triton's own path:
the helper runs the same code on the same patched language either way.
"""

import inspect

import triton.language as tl


def install() -> bool:
    """Wrap `InterpretedFunction.__call__` (the nested-call path); False, changing nothing, where this Triton's
    interpreter does not have the internals it relies on."""
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
