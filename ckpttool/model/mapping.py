"""Declarative key mappings between architectures' names (``ckpttool edit --map``): data,
never code. Pure: parsing, matching and planning; the values are moved by the command.

A map is a JSON (or YAML) object::

    {"params": {"n_heads": 4, "n_kv_heads": 2},
     "unmatched": "error",
     "rules": [
       {"from": "tok_embeddings.weight", "to": "model.embed_tokens.weight"},
       {"from": "layers.{L}.attention.wq.weight", "to": "model.layers.{L}.self_attn.q_proj.weight",
        "op": "rope_to_hf", "heads": "n_heads"},
       {"from": ["l.{L}.q", "l.{L}.k", "l.{L}.v"], "to": "l.{L}.qkv", "op": "concat", "dim": 0},
       {"from": "l.{L}.qkv", "to": ["l.{L}.q", "l.{L}.k", "l.{L}.v"], "op": "split", "dim": 0,
        "sizes": [64, 32, 32]},
       {"from": "l.{L}.qkv", "to": ["l.{L}.q", "l.{L}.k", "l.{L}.v"], "op": "split_qkv",
        "heads": "n_heads", "groups": "n_kv_heads"},
       {"from": "w", "to": "w_t", "op": "transpose"}]}

``{NAME}`` in a key matches one dotted segment and carries it to the targets. Rules are tried
in order; a tensor matched by none is an error (``"unmatched": "error"``), kept as it is
(``"keep"``) or left out (``"drop"``). ``op`` is ``rename`` (the default), ``transpose`` (2-D),
``concat`` / ``split`` along ``dim`` (``sizes``: ints or param names; a split without sizes
makes equal parts), ``split_qkv`` / ``concat_qkv`` (Megatron-Core's fused QKV rows, grouped by
query group: for each of ``groups`` groups, its ``heads / groups`` query heads, then its key
head, then its value head, ``get_query_key_value_tensors``; ``heads`` and ``groups`` name the
params holding the numbers of query heads and of query groups, the head size is what the rows
leave), or the rotary permutations between Meta's interleaved layout of q/k rows and Hugging
Face's half-split one (``rope_to_hf``, ``rope_to_meta``; ``heads``: the param holding the
number of heads of that projection). Presets ship in :data:`PRESETS`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import InputError

OPS = (
    "rename", "transpose", "concat", "split", "rope_to_hf", "rope_to_meta", "split_qkv",
    "concat_qkv",
)  # fmt: skip


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    op: str = "rename"
    dim: int = 0
    heads: str | None = None
    sizes: tuple[Any, ...] = ()
    groups: str | None = None


@dataclass(frozen=True)
class MapSpec:
    rules: tuple[Rule, ...]
    params: dict[str, int]
    unmatched: str = "error"
    name: str = ""


@dataclass(frozen=True)
class Step:
    """One rule applied to concrete keys: ``op`` from ``sources`` to ``targets``."""

    rule: Rule
    sources: tuple[str, ...]
    targets: tuple[str, ...]


def _llama(to_hf: bool) -> dict[str, Any]:
    """Meta's Llama names (the reference code, torchtitan) and Hugging Face's, both ways."""
    meta_hf = [
        ("tok_embeddings.weight", "model.embed_tokens.weight", None),
        ("norm.weight", "model.norm.weight", None),
        ("output.weight", "lm_head.weight", None),
        ("layers.{L}.attention.wq.weight", "model.layers.{L}.self_attn.q_proj.weight", "n_heads"),
        ("layers.{L}.attention.wk.weight", "model.layers.{L}.self_attn.k_proj.weight",
         "n_kv_heads"),
        ("layers.{L}.attention.wv.weight", "model.layers.{L}.self_attn.v_proj.weight", None),
        ("layers.{L}.attention.wo.weight", "model.layers.{L}.self_attn.o_proj.weight", None),
        ("layers.{L}.feed_forward.w1.weight", "model.layers.{L}.mlp.gate_proj.weight", None),
        ("layers.{L}.feed_forward.w2.weight", "model.layers.{L}.mlp.down_proj.weight", None),
        ("layers.{L}.feed_forward.w3.weight", "model.layers.{L}.mlp.up_proj.weight", None),
        ("layers.{L}.attention_norm.weight", "model.layers.{L}.input_layernorm.weight", None),
        ("layers.{L}.ffn_norm.weight", "model.layers.{L}.post_attention_layernorm.weight", None),
    ]  # fmt: skip
    rules = []
    for meta, hf, heads in meta_hf:
        source, target = (meta, hf) if to_hf else (hf, meta)
        rule: dict[str, Any] = {"from": source, "to": target}
        if heads:
            rule.update(op="rope_to_hf" if to_hf else "rope_to_meta", heads=heads)
        rules.append(rule)
    return {"unmatched": "error", "rules": rules}


#: Hugging Face ``LlamaForCausalLM``'s tensor names, each with the number of heads its rows
#: hold when its rows are rotary q/k rows (``None`` otherwise).
HF_LLAMA = (
    ("model.embed_tokens.weight", None),
    ("model.layers.{L}.self_attn.q_proj.weight", "n_heads"),
    ("model.layers.{L}.self_attn.k_proj.weight", "n_kv_heads"),
    ("model.layers.{L}.self_attn.v_proj.weight", None),
    ("model.layers.{L}.self_attn.o_proj.weight", None),
    ("model.layers.{L}.input_layernorm.weight", None),
    ("model.layers.{L}.post_attention_layernorm.weight", None),
    ("model.layers.{L}.mlp.gate_proj.weight", None),
    ("model.layers.{L}.mlp.down_proj.weight", None),
    ("model.layers.{L}.mlp.up_proj.weight", None),
    ("model.norm.weight", None),
    ("lm_head.weight", None),
)


def _minimind() -> dict[str, Any]:
    """MiniMind (jingyaogong/minimind ``MiniMindForCausalLM``, dense) and Hugging Face Llama:
    the same names, and the same rotary layout (MiniMind rotates halves, ``rotate_half``, as
    transformers does), so the map is names only. It is a check as much as a map: a tensor it
    does not name (MiniMind's MoE experts and router, which Llama has no place for) is an
    error."""
    return {"unmatched": "error", "rules": [{"from": hf, "to": hf} for hf, _ in HF_LLAMA]}


#: llama.cpp's GGUF names for the Hugging Face Llama tensors (gguf-py's ``TensorNameMap`` for
#: ``MODEL_ARCH.LLAMA``), in :data:`HF_LLAMA`'s order.
GGUF_LLAMA = (
    "token_embd.weight", "blk.{L}.attn_q.weight", "blk.{L}.attn_k.weight",
    "blk.{L}.attn_v.weight", "blk.{L}.attn_output.weight", "blk.{L}.attn_norm.weight",
    "blk.{L}.ffn_norm.weight", "blk.{L}.ffn_gate.weight", "blk.{L}.ffn_down.weight",
    "blk.{L}.ffn_up.weight", "output_norm.weight", "output.weight",
)  # fmt: skip


def _gguf_llama() -> dict[str, Any]:
    """llama.cpp's Llama GGUF names to Hugging Face's. ``convert_hf_to_gguf.py``
    (``LlamaModel.permute``) reorders q_proj's and k_proj's rows from Hugging Face's half-split
    rotary layout to the interleaved one llama.cpp's kernel uses (Meta's), with k's heads being
    ``num_key_value_heads``: undone here by ``rope_to_hf``. ``rope_freqs.weight`` (Llama 3's
    scaled frequencies, which transformers computes from config.json) has no counterpart."""
    rules: list[dict[str, Any]] = []
    for gguf, (hf, heads) in zip(GGUF_LLAMA, HF_LLAMA):
        rule: dict[str, Any] = {"from": gguf, "to": hf}
        if heads:
            rule.update(op="rope_to_hf", heads=heads)
        rules.append(rule)
    return {"unmatched": "error", "rules": rules}


#: Megatron-Core ``GPTModel``'s names (its ``state_dict()``, local layer spec) and Hugging Face
#: ``LlamaForCausalLM``'s, in :data:`HF_LLAMA`'s order; ``None``: the fused QKV and fc1 rows.
MEGATRON_GPT = (
    "embedding.word_embeddings.weight", None, None, None,
    "decoder.layers.{L}.self_attention.linear_proj.weight",
    "decoder.layers.{L}.input_layernorm.weight", "decoder.layers.{L}.pre_mlp_layernorm.weight",
    None, "decoder.layers.{L}.mlp.linear_fc2.weight", None, "decoder.final_layernorm.weight",
    "output_layer.weight",
)  # fmt: skip
#: Transformer Engine's layer spec fuses the norms into the next linear: the names it saves
#: (and ``sharded_state_dict``'s, whatever the spec), for the local spec's norms.
MEGATRON_TE_NORMS = {
    "decoder.layers.{L}.input_layernorm.weight":
        "decoder.layers.{L}.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.{L}.pre_mlp_layernorm.weight":
        "decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight",
}  # fmt: skip
MEGATRON_QKV = "decoder.layers.{L}.self_attention.linear_qkv.weight"
MEGATRON_FC1 = "decoder.layers.{L}.mlp.linear_fc1.weight"
HF_QKV = [HF_LLAMA[i][0] for i in (1, 2, 3)]
HF_FC1 = [HF_LLAMA[7][0], HF_LLAMA[9][0]]  # gate_proj, up_proj


def _megatron_gpt(to_hf: bool) -> dict[str, Any]:
    """Megatron-Core ``GPTModel`` (RMSNorm, SwiGLU, rotary, no biases, untied output layer) and
    Hugging Face Llama. ``linear_qkv``'s rows are grouped by query group (``split_qkv``, with
    ``n_heads`` = ``num_attention_heads`` and ``n_kv_heads`` = ``num_query_groups``);
    ``linear_fc1``'s are ``[gate; up]`` (``glu``: ``act(first half) * second half``). Megatron's
    default rotary (``rotary_interleaved=False``: ``_rotate_half`` rotates halves) is Hugging
    Face's layout, so q and k rows are not permuted. From Megatron the names are read with or
    without Megatron-LM's ``model.`` prefix (a checkpoint's, or a bare ``state_dict()``) and
    with either layer spec's norm names; to Megatron they are a bare local-spec
    ``state_dict()``'s."""
    rules: list[dict[str, Any]] = []
    qkv = {"heads": "n_heads", "groups": "n_kv_heads"}
    for prefix in ("", "model.") if to_hf else ("",):
        for megatron, (hf, _) in zip(MEGATRON_GPT, HF_LLAMA):
            if megatron is None:
                continue
            names = (
                [megatron, MEGATRON_TE_NORMS[megatron]]
                if megatron in MEGATRON_TE_NORMS
                else [megatron]
            )
            for name in names if to_hf else names[:1]:
                rules.append(
                    {"from": prefix + name, "to": hf} if to_hf else {"from": hf, "to": name}
                )
        if to_hf:
            rules.append({"from": prefix + MEGATRON_QKV, "to": HF_QKV, "op": "split_qkv", **qkv})
            rules.append({"from": prefix + MEGATRON_FC1, "to": HF_FC1, "op": "split", "dim": 0})
        else:
            rules.append({"from": HF_QKV, "to": MEGATRON_QKV, "op": "concat_qkv", **qkv})
            rules.append({"from": HF_FC1, "to": MEGATRON_FC1, "op": "concat", "dim": 0})
    return {"unmatched": "error", "rules": rules}


#: Maps shipped with ckpttool, by name (``--map llama-meta-to-hf``). Their ``n_heads`` and
#: ``n_kv_heads`` come from ``--map-param`` or a ``config.json`` / ``params.json`` beside the
#: checkpoint (Megatron's: from its ``args``).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-meta-to-hf": _llama(to_hf=True),
    "llama-hf-to-meta": _llama(to_hf=False),
    "llama-gguf-to-hf": _gguf_llama(),
    "minimind-to-hf-llama": _minimind(),
    "hf-llama-to-minimind": _minimind(),
    "megatron-gpt-to-hf-llama": _megatron_gpt(to_hf=True),
    "hf-llama-to-megatron-gpt": _megatron_gpt(to_hf=False),
}

#: Where a config beside the checkpoint keeps the numbers a map's params name.
#: A GGUF file declares them itself (``llama.attention.head_count``...), as the facts the
#: caller passes.
CONFIG_PARAMS = {
    "n_heads": ("n_heads", "num_attention_heads", "llama.attention.head_count"),
    "n_kv_heads": (
        "n_kv_heads", "num_key_value_heads", "llama.attention.head_count_kv", "num_query_groups",
        "n_heads", "num_attention_heads", "llama.attention.head_count",
    ),
}  # fmt: skip


def load_map(
    name: str,
    params: dict[str, int],
    beside: Path | Sequence[Path] | None = None,
    facts: Sequence[Mapping[str, Any]] = (),
) -> MapSpec:
    """A preset by name, or a JSON/YAML map file; ``params`` override the file's, and the
    ones still missing come from ``facts`` (key/values a checkpoint declares about its model,
    such as a GGUF file's), then from a ``config.json``/``params.json`` in ``beside`` (a
    folder, or several tried in order)."""
    if name in PRESETS:
        data = PRESETS[name]
    else:
        path = Path(name)
        if not path.is_file():
            raise InputError(f"--map {name}: no such file, and not a preset ({', '.join(PRESETS)})")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except ImportError:
            raise InputError(
                f"--map {name}: reading YAML needs PyYAML (pip install pyyaml)"
            ) from None
        except Exception as error:  # json / yaml syntax errors
            raise InputError(f"--map {name}: not a valid map file ({error})") from None
    return _spec(name, data, params, beside, facts)


def _spec(
    name: str,
    data: Any,
    params: dict[str, int],
    beside: Path | Sequence[Path] | None,
    facts: Sequence[Mapping[str, Any]] = (),
) -> MapSpec:
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise InputError(f"--map {name}: expected an object with a list of rules")
    merged = {k: v for k, v in (data.get("params") or {}).items()}
    merged.update(params)
    rules = tuple(_rule(name, i, raw) for i, raw in enumerate(data["rules"]))
    wanted = {p for r in rules for p in (r.heads, r.groups) if p} | {
        s for r in rules for s in r.sizes if isinstance(s, str)
    }
    for param in sorted(wanted - set(merged)):
        value = _declared(param, facts)
        if value is None:
            value = _from_config(param, beside)
        if value is None:
            raise InputError(
                f"--map {name}: needs {param}: pass --map-param {param}=N, or put a config.json "
                "or params.json beside the checkpoint"
            )
        merged[param] = value
    for param, value in merged.items():
        if not isinstance(value, int) or value <= 0:
            raise InputError(f"--map {name}: param {param} must be a positive integer")
    unmatched = data.get("unmatched", "error")
    if unmatched not in ("error", "keep", "drop"):
        raise InputError(f"--map {name}: unmatched must be error, keep or drop")
    return MapSpec(rules, merged, unmatched, name)


def _rule(name: str, index: int, raw: Any) -> Rule:
    where = f"--map {name}: rule {index + 1}"
    if not isinstance(raw, dict) or "from" not in raw or "to" not in raw:
        raise InputError(f"{where}: expected an object with from and to")
    sources = tuple(raw["from"] if isinstance(raw["from"], list) else [raw["from"]])
    targets = tuple(raw["to"] if isinstance(raw["to"], list) else [raw["to"]])
    op = raw.get("op", "rename")
    if op not in OPS:
        raise InputError(f"{where}: op {op!r} is not one of {', '.join(OPS)}")
    if not all(isinstance(k, str) and k for k in (*sources, *targets)):
        raise InputError(f"{where}: keys must be non-empty strings")
    many = {"concat": (None, 1), "split": (1, None), "split_qkv": (1, 3), "concat_qkv": (3, 1)}.get(
        op, (1, 1)
    )
    if (many[0] and len(sources) != many[0]) or (many[1] and len(targets) != many[1]):
        raise InputError(f"{where}: {op} takes {_counts(op)}")
    if (op == "concat" and len(sources) < 2) or (op == "split" and len(targets) < 2):
        raise InputError(f"{where}: {op} takes {_counts(op)}")
    holes = set(_holes(sources[0]))
    for key in (*sources, *targets):
        if set(_holes(key)) != holes:
            raise InputError(f"{where}: every key must use the same {{names}}")
    sizes = tuple(raw.get("sizes", ()))
    if op == "split" and sizes and len(sizes) != len(targets):
        raise InputError(f"{where}: split needs one size per target (or none: equal parts)")
    heads = raw.get("heads")
    if (op.startswith("rope") or op.endswith("_qkv")) and not isinstance(heads, str):
        raise InputError(f"{where}: {op} needs heads (the param holding the number of heads)")
    groups = raw.get("groups")
    if op.endswith("_qkv") and not isinstance(groups, str):
        raise InputError(
            f"{where}: {op} needs groups (the param holding the number of query groups)"
        )
    dim = raw.get("dim", 0)
    if not isinstance(dim, int):
        raise InputError(f"{where}: dim must be an integer")
    return Rule(sources, targets, op, dim, heads, sizes, groups if op.endswith("_qkv") else None)


def _counts(op: str) -> str:
    return {
        "concat": "several sources and one target", "split": "one source and several targets",
        "split_qkv": "one source and three targets (q, k, v)",
        "concat_qkv": "three sources (q, k, v) and one target",
    }[op]  # fmt: skip


def _holes(key: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", key)


def _pattern(key: str) -> re.Pattern[str]:
    parts = re.split(r"(\{\w+\})", key)
    regex = "".join(
        f"(?P<{p[1:-1]}>[^.]+)" if re.fullmatch(r"\{\w+\}", p) else re.escape(p) for p in parts
    )
    return re.compile(regex + r"\Z")


def _fill(key: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], key)


def _declared(param: str, facts: Sequence[Mapping[str, Any]]) -> int | None:
    for declared in facts:
        for key in CONFIG_PARAMS.get(param, (param,)):
            value = declared.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _from_config(param: str, beside: Path | Sequence[Path] | None) -> int | None:
    folders = [beside] if isinstance(beside, Path) else list(beside or ())
    for folder in folders:
        for file in ("config.json", "params.json"):
            path = folder / file
            if not path.is_file():
                continue
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for key in CONFIG_PARAMS.get(param, (param,)):
                value = config.get(key) if isinstance(config, dict) else None
                if isinstance(value, int):
                    return value
    return None


def plan(keys: list[str], spec: MapSpec) -> tuple[list[Step], list[str]]:
    """The steps that map ``keys`` (a state dict's), and the keys no rule matched. Each key is
    used by one step; a step whose other sources are missing is an error naming them; two
    steps writing one key is an error."""
    present = set(keys)
    used: set[str] = set()
    written: dict[str, str] = {}
    steps = []
    for key in keys:
        if key in used:
            continue
        for rule in spec.rules:
            for source in rule.sources:
                match = _pattern(source).match(key)
                if match is None:
                    continue
                values = match.groupdict()
                sources = tuple(_fill(s, values) for s in rule.sources)
                missing = [s for s in sources if s not in present]
                if missing:
                    raise InputError(
                        f"--map {spec.name}: {key!r} matches a rule that also needs {missing}"
                    )
                targets = tuple(_fill(t, values) for t in rule.targets)
                for target in targets:
                    if target in written:
                        raise InputError(
                            f"--map {spec.name}: {written[target]!r} and {key!r} both map to "
                            f"{target!r}"
                        )
                    written[target] = key
                used.update(sources)
                steps.append(Step(rule, sources, targets))
                break
            else:
                continue
            break
    unmatched = [key for key in keys if key not in used]
    if unmatched and spec.unmatched == "error":
        raise InputError(
            f"--map {spec.name}: no rule maps {len(unmatched)} tensor(s): "
            f"{', '.join(unmatched[:5])}{' ...' if len(unmatched) > 5 else ''} "
            '(set "unmatched": "keep" or "drop" in the map to allow that)'
        )
    if spec.unmatched == "keep":
        for key in unmatched:
            if key in written:
                raise InputError(f"--map {spec.name}: {key!r} is kept and also written by a rule")
    return steps, unmatched
