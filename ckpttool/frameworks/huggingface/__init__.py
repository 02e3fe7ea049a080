"""Hugging Face transformers: model directories, Trainer checkpoints, and convert's model-directory output."""
