"""Checkpoints frameworks write as several files: one folder per framework, listed in a registry."""
