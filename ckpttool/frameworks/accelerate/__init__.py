"""accelerate's ``Accelerator.save_state`` folders."""
