"""torchtitan's ``step-N/`` checkpoint directories (DCP)."""
