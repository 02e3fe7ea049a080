"""One DeepSpeed load of tests/test_repair_directory.py, under torchrun (1 process, gloo, CPU).

``SAVE_DIR STAGE DTYPE``: build the DeepSpeed fixtures' tiny model and engine
(tests/fixtures/deepspeed/model.py) and ``engine.load_checkpoint(SAVE_DIR)`` with ``tag=None``:
DeepSpeed reads ``SAVE_DIR/latest`` and loads the tag it names. The last line printed is JSON:
the path it loaded and the engine's step counter.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def load(save_dir: str, stage: int, dtype: str) -> dict[str, object]:
    import deepspeed

    from tests.fixtures.deepspeed.model import ds_config, tiny_ds

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_ds()
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trained, config=ds_config(stage, dtype, 1)
    )
    load_path, _ = engine.load_checkpoint(save_dir)
    torch.distributed.destroy_process_group()
    return {"load_path": load_path, "global_steps": engine.global_steps}


if __name__ == "__main__":
    result = load(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    print(json.dumps(result), flush=True)
    os._exit(0)
