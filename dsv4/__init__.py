"""dsv4: DeepSeek-V4 inference, exact on CPU, fast on Hopper.

`import dsv4` stays light: public names are imported on first use.
"""

from importlib import import_module
from types import MappingProxyType

# public name -> module defining it (imported when the name is first used)
_LAZY = MappingProxyType({
    "load": "dsv4.checkpoint.loader",
    "LLM": "dsv4.api",
    "SamplingParams": "dsv4.runtime.params",
    "RequestOutput": "dsv4.runtime.params",
    "CompletionOutput": "dsv4.runtime.params",
    "RequestError": "dsv4.runtime.params",
    "RequestTypeError": "dsv4.runtime.params",
    "RequestFailed": "dsv4.api",
    "WorkerFailure": "dsv4.runtime.spmd",
    "LayoutError": "dsv4.parallel",
})

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
