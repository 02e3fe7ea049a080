"""Megatron-LM / Megatron-Core checkpoints: ``torch_dist`` directories and legacy ``mp_rank`` shards."""
