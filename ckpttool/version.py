"""ckpttool's version, on the ground floor: what a written file records as its writer
(``convert``'s metadata) and ``ckpttool --version`` prints, with nothing above it imported."""

__version__ = "0.1.0"
