"""Runtime: tokenizer, chat encoding, sampling and request types (engine, caches and scheduler come later).

Modules are imported directly (`dsv4.runtime.sampler`, ...) so that importing one does not load the others.
"""
