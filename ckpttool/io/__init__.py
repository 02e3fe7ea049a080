"""Bytes: where they come from (a local file or a URL), how they are written durably, progress."""
