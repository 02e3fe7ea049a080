"""A tiny Llama-shaped megatron-core (0.16.1) ``GPTModel`` on CPU, for the
``megatron-gpt-to-hf-llama`` / ``hf-llama-to-megatron-gpt`` presets' tests: RMSNorm, SwiGLU,
rotary, grouped-query attention (4 query heads in 2 query groups), no biases, an untied output
layer, the local (non Transformer Engine) layer spec.

Run in a process of its own (it stubs ``torch.cuda.synchronize``/``current_device`` and the
CUDA RNG tracker's ``fork``, and starts a one-process gloo group, as megatron-core needs):
``python -m tests.support.megatron_gpt OUT [STATE]`` writes to the folder ``OUT``:

- ``state.pt``: the model's ``state_dict()`` (``torch.save``), tensors only;
- ``legacy/``: the same as a Megatron-LM legacy checkpoint (``iter_0000001/mp_rank_00/
  model_optim_rng.pt``: ``args``, ``checkpoint_version``, ``iteration``, ``model``), its
  tracker file beside it;
- ``dist/iter_0000001/``: the same as a torch_dist checkpoint (``dist_checkpointing.save`` of
  the model's ``sharded_state_dict()``, layers stacked, norms under Transformer Engine's
  names, with the same common entries);
- ``logits.pt``: megatron-core's forward of :data:`IDS` (``[1, SEQ, VOCAB]``).

With ``STATE`` (a state dict file: ``torch.save`` or safetensors) the model loads it first (``strict=False``: the local
spec's ``_extra_state`` entries may be missing, nothing else) and only ``logits.pt`` is
written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

import torch

VOCAB, SEQ, LAYERS, HIDDEN, FFN, HEADS, GROUPS = 64, 12, 2, 32, 48, 4, 2
#: The input both models run on.
IDS = [[3, 17, 42, 5, 63, 0, 28, 9, 51, 11, 36, 7]]
#: The matching transformers ``LlamaConfig``.
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=SEQ,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
    mlp_bias=False, hidden_act="silu",
)  # fmt: skip


def _model() -> torch.nn.Module:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=1e-5,
        add_bias_linear=False, pipeline_dtype=torch.float32, init_method_std=0.3,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(
        config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
        rotary_base=10000, share_embeddings_and_output_weights=False,
    )  # fmt: skip
    # RMSNorm weights start at one: made distinct so that a swapped norm shows in the logits
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.copy_(torch.rand_like(param) + 0.5)
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor(IDS)
    positions = torch.arange(ids.shape[1])[None]
    causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1]), diagonal=1).bool()[None, None]
    with torch.no_grad():
        return model(ids, positions, attention_mask=causal)


def main(out: str, state: str | None = None) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo")
    model = _model()
    if state is not None:
        if state.endswith(".safetensors"):
            from safetensors.torch import load_file

            loaded = load_file(state)
        else:
            loaded = torch.load(state, weights_only=True)
        result = model.load_state_dict(loaded, strict=False)
        assert not result.unexpected_keys, result.unexpected_keys
        assert all(k.endswith("._extra_state") for k in result.missing_keys), result.missing_keys
    else:
        weights = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        torch.save(weights, os.path.join(out, "state.pt"))
        args = argparse.Namespace(
            num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
            num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
            swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
            seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
            world_size=1, iteration=1,
        )  # fmt: skip
        shard = os.path.join(out, "legacy", "iter_0000001", "mp_rank_00")
        os.makedirs(shard)
        saved = {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": weights}
        torch.save(saved, os.path.join(shard, "model_optim_rng.pt"))
        with open(os.path.join(out, "legacy", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
        from megatron.core import dist_checkpointing

        folder = os.path.join(out, "dist", "iter_0000001")
        os.makedirs(folder)
        common = {key: saved[key] for key in ("args", "checkpoint_version", "iteration")}
        dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, folder)
    torch.save(_logits(model), os.path.join(out, "logits.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
