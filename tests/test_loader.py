"""Checkpoint loading: sharded files with an index, and errors that name the bad weight."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import GREEDY
from nano_qwen3tts_vllm.config import EngineConfig, ModelConfig
from nano_qwen3tts_vllm.engine.llm_engine import LLMEngine


def copy_with(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    edit(weights)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def engine(d: str) -> LLMEngine:
    return LLMEngine(d, EngineConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=256),
                     device="cpu", dtype=torch.float32)


def test_sharded_checkpoint_loads_the_same(ckpt, ours, tmp_path):
    src = ckpt("tiny-random")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: weights[n] for n in part}, dst / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    kw = dict(speaker="vivian", language="english", max_new_tokens=10, **GREEDY)
    a, _ = ours(src).generate_custom_voice("Sharded or not.", **kw)
    b, _ = ours(str(dst)).generate_custom_voice("Sharded or not.", **kw)
    assert torch.equal(torch.from_numpy(a[0]), torch.from_numpy(b[0]))


def test_missing_weight_is_named(ckpt, tmp_path):
    d = copy_with(ckpt("tiny-random"), tmp_path / "m", lambda w: w.pop("talker.model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights.*talker\.model\.layers\.1\.mlp\.up_proj\.weight"):
        engine(d)


def test_unexpected_weight_is_named(ckpt, tmp_path):
    d = copy_with(ckpt("tiny-random"), tmp_path / "u",
                  lambda w: w.__setitem__("talker.model.layers.9.self_attn.q_proj.weight", torch.zeros(4, 4)))
    with pytest.raises(ValueError, match=r"unexpected weights.*talker\.model\.layers\.9\.self_attn\.q_proj"):
        engine(d)


def test_misshaped_weight_is_named(ckpt, tmp_path):
    def shrink(w):
        w["talker.code_predictor.lm_head.3.weight"] = w["talker.code_predictor.lm_head.3.weight"][:100]
    d = copy_with(ckpt("tiny-random"), tmp_path / "s", shrink)
    with pytest.raises(ValueError, match=r"talker\.code_predictor\.lm_head\.3\.weight has shape \(100, 48\)"):
        engine(d)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="qwen3_tts"):
        ModelConfig.from_pretrained(tmp_path)


def test_speaker_ids_may_be_lists(ckpt):
    cfg = json.loads((Path(ckpt("tiny-random")) / "config.json").read_text())
    cfg["talker_config"]["spk_id"] = {k: [v] for k, v in cfg["talker_config"]["spk_id"].items()}
    assert ModelConfig.from_dict(cfg).speaker_ids["vivian"] == 3000
