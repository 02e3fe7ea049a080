"""``diff``: two checkpoints compared: which tensors pair up, their sections, their values."""
