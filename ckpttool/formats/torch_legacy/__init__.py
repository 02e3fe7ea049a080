"""torch.save's legacy format (torch < 1.6: a stream of pickles, then the storages' bytes) and
bare pickles: what ``torch.load`` reads from any file that is not a zip (:mod:`.format`)."""
