"""``convert``: weights to safetensors or ``.pth`` and back: the plan, the output's files, the run."""
