"""torch.save's zip format: the archive's directory, its reader and writer, verify, in-place field rewrites."""
