"""torch.distributed.checkpoint directories: ``.metadata``, the data files, their verify, the walker's fast path."""
