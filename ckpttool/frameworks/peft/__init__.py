"""PEFT (Hugging Face parameter-efficient fine-tuning) adapter directories: a framework plug-in."""
