"""The framework registry: one line per framework, in detection order, imported only when asked."""

from __future__ import annotations

import subprocess
import sys

from ckpttool.frameworks.base import Framework
from ckpttool.frameworks.registry import FRAMEWORKS, framework_of, frameworks, load


def test_each_line_names_a_framework_that_detects_the_layouts_it_lists() -> None:
    for spec, layouts in FRAMEWORKS:
        framework = load(spec)
        assert isinstance(framework, Framework), spec
        assert framework.layouts == layouts, spec
        assert all(framework_of(layout) is framework for layout in layouts)
    assert framework_of("state_dict") is None and framework_of(None) is None


def test_detection_order() -> None:
    """The DCP-based layouts first (Lightning's meta.pt, torchtitan's step-N/, torchtune's
    epoch_N/ name their folders by files or names no other framework claims), then PEFT (a
    Trainer checkpoint-N/ of a PEFT model holds an adapter, not the weights), sentence-transformers
    (its root module is a Hugging Face model directory) and diffusers, accelerate before
    Hugging Face (its folders hold a model.safetensors too), DeepSpeed next (a Trainer
    checkpoint-N/ of a DeepSpeed run holds a global_stepN/), Megatron, per-rank sets (any
    directory of *rank<N>.pt files), and the generic container of checkpoint files last (any
    folder of differently named ones: after every framework that names its files)."""
    assert [f.name for f in frameworks()] == [
        "lightning_sharded", "torchtitan", "torchtune", "peft", "sentence_transformers",
        "diffusers", "accelerate", "huggingface", "deepspeed", "megatron", "rank_set",
        "checkpoint_parts",
    ]  # fmt: skip


def test_finding_no_framework_imports_none() -> None:
    code = (
        "import sys; from ckpttool.frameworks.registry import framework_of; "
        "framework_of('state_dict'); "
        "print(sorted(m for m in sys.modules if m.startswith('ckpttool.frameworks.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['ckpttool.frameworks.registry']"
