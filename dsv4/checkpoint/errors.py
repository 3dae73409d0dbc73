"""Errors of the checkpoint layer. Messages name the file and the checkpoint key at fault."""


class CheckpointError(ValueError):
    """A checkpoint dsv4 refuses: unknown dialect, unreadable shard, missing/extra/mismatched tensors."""
