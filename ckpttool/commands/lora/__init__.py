"""``ckpttool lora``: LoRA adapters and their bases (merge)."""
