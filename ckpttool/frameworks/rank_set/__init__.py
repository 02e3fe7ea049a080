"""Sets of per-rank ``torch.save`` state dicts (FSDP2 / tensor-parallel DTensors) as one checkpoint."""
