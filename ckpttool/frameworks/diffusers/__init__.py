"""diffusers model folders, EMAModel saves and pipeline folders."""
