"""Lightning's sharded checkpoints: a DCP directory plus ``meta.pt``."""
