"""Runtime: decode cache, scheduler, engine, sampling, request types, tokenizer, chat encoding, demo model.

Modules are imported directly (`dsv4.runtime.sampler`, ...) so that importing one does not load the others.
"""
