"""torchtune's checkpoint files (``epoch_N/`` folders and the older flat layout)."""
