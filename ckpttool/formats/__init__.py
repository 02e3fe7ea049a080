"""File formats as plug-ins: one module or folder each, listed in :mod:`ckpttool.formats.registry`."""
