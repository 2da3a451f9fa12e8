"""Load official Qwen3-TTS checkpoints (model.safetensors, or sharded with an index) into our modules.

Every checkpoint name is mapped explicitly: a missing, unexpected or mis-shaped weight is an
error that names it. q/k/v and gate/up are copied into row slices of the merged projections.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig

logger = logging.getLogger(__name__)

# checkpoint name -> (part, our parameter name, (row start, row count) or None, or an int index)
Layout = dict[str, tuple[str, str, object]]

_LAYER_SIMPLE = ["self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]


def _layer_entries(layout: Layout, part: str, ckpt_prefix: str, our_prefix: str, dc) -> None:
    q, kv, inter = dc.num_heads * dc.head_dim, dc.num_kv_heads * dc.head_dim, dc.intermediate_size
    for n in range(dc.num_layers):
        c, o = f"{ckpt_prefix}.layers.{n}.", f"{our_prefix}.layers.{n}."
        for name in _LAYER_SIMPLE:
            layout[c + name] = (part, o + name, None)
        layout[c + "self_attn.q_proj.weight"] = (part, o + "self_attn.qkv_proj.weight", (0, q))
        layout[c + "self_attn.k_proj.weight"] = (part, o + "self_attn.qkv_proj.weight", (q, kv))
        layout[c + "self_attn.v_proj.weight"] = (part, o + "self_attn.qkv_proj.weight", (q + kv, kv))
        layout[c + "mlp.gate_proj.weight"] = (part, o + "mlp.gate_up_proj.weight", (0, inter))
        layout[c + "mlp.up_proj.weight"] = (part, o + "mlp.gate_up_proj.weight", (inter, inter))
    layout[f"{ckpt_prefix}.norm.weight"] = (part, f"{our_prefix}.norm.weight", None)


def checkpoint_layout(cfg: ModelConfig) -> Layout:
    """Every talker / code-predictor weight an official checkpoint holds, and where it goes.

    The codec embeddings go to both parts ("both"): the talker needs all 16 to embed frames,
    the predictor to embed its own inputs.
    """
    layout: Layout = {}
    layout["talker.model.text_embedding.weight"] = ("talker", "text.text_embedding.weight", None)
    for fc in ("linear_fc1", "linear_fc2"):
        for kind in ("weight", "bias"):
            layout[f"talker.text_projection.{fc}.{kind}"] = ("talker", f"text.{fc}.{kind}", None)
    layout["talker.codec_head.weight"] = ("talker", "codec_head.weight", None)
    _layer_entries(layout, "talker", "talker.model", "model", cfg.talker)

    v0, v = cfg.codec_vocab_size, cfg.predictor_vocab_size
    layout["talker.model.codec_embedding.weight"] = ("both", "codec.weight", (0, v0))
    for i in range(cfg.num_code_groups - 1):
        layout[f"talker.code_predictor.model.codec_embedding.{i}.weight"] = ("both", "codec.weight", (v0 + i * v, v))
        layout[f"talker.code_predictor.lm_head.{i}.weight"] = ("predictor", "lm_heads", i)
    _layer_entries(layout, "predictor", "talker.code_predictor.model", "model", cfg.predictor)
    if cfg.predictor.hidden_size != cfg.talker.hidden_size:
        for kind in ("weight", "bias"):
            layout[f"talker.code_predictor.small_to_mtp_projection.{kind}"] = (
                "predictor", f"small_to_mtp_projection.{kind}", None)
    return layout


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, "callable"]]:
    """(name, loader) for every tensor in model.safetensors or the shards an index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    for fname in files:
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for name in f.keys():
                yield name, (lambda f=f, name=name: f.get_tensor(name))


def load_weights(module: nn.Module, part: str, model_dir: str | Path, cfg: ModelConfig) -> None:
    """Fill `module` (the talker or the code predictor) from the checkpoint; strict."""
    layout = checkpoint_layout(cfg)
    params = dict(module.named_parameters())
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, get in iter_checkpoint(model_dir):
        if name.startswith("speaker_encoder."):
            continue
        if name not in layout:
            unexpected.append(name)
            continue
        seen.add(name)
        target_part, pname, shard = layout[name]
        if target_part not in (part, "both"):
            continue
        _copy(params[pname], shard, get(), name, pname)
    if unexpected:
        raise ValueError(f"unexpected weights in {model_dir} (not part of a Qwen3-TTS 12Hz checkpoint of this "
                         f"config): {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    missing = [n for n, (p, _, _) in layout.items() if p in (part, "both") and n not in seen]
    if missing:
        raise ValueError(f"missing weights in {model_dir}: {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
                         "is the checkpoint complete and its config.json the one it was saved with?")
    logger.info("loaded %d %s weights from %s", len(seen), part, model_dir)


def _copy(param: torch.Tensor, shard, tensor: torch.Tensor, name: str, pname: str) -> None:
    if shard is None:
        dst = param.data
    elif isinstance(shard, int):
        dst = param.data[shard]
    else:
        dst = param.data[shard[0]:shard[0] + shard[1]]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, but the config implies "
                         f"{tuple(dst.shape)} (for {pname}); does config.json match model.safetensors?")
    dst.copy_(tensor.to(dst.dtype))
