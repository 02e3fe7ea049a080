"""``rescale-step``: a resume checkpoint, or a framework's directory, moved to another number of GPUs."""
