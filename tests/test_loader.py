"""Loading checkpoint folders: sharded ones, and malformed ones that must say what is wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import miniinfer as mi
from miniinfer.course.parity import make_hf_model


@pytest.fixture
def folder(tmp_path):
    make_hf_model("qwen2").save_pretrained(tmp_path)
    return tmp_path


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ids = torch.arange(13)[None]
    with torch.no_grad():
        torch.testing.assert_close(mi.load_model(tmp_path)(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(mi.CheckpointError, match="no config.json"):
        mi.load_model(folder)


def test_missing_weights_file(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(mi.CheckpointError, match="no model.safetensors"):
        mi.load_model(folder)


def test_missing_shard(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path, max_shard_size="100KB")
    next(tmp_path.glob("model-*.safetensors")).unlink()
    with pytest.raises(mi.CheckpointError, match="shards listed in model.safetensors.index.json"):
        mi.load_model(tmp_path)


def test_missing_tensor_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(mi.CheckpointError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.bias'\]"):
        mi.load_model(folder)


def test_mismatched_tensor_is_named(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(71)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(mi.CheckpointError, match=r"model.norm.weight has shape \(71,\), the config implies \(72,\)"):
        mi.load_model(folder)


def test_config_that_disagrees_with_weights(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mi.CheckpointError, match="missing tensors.*model.layers.2"):
        mi.load_model(folder)


def test_tokenizer_and_model_default_to_the_course_model(tmp_path):
    assert mi.load_model().cfg.vocab_size == len(mi.load_tokenizer())
    shutil.copytree(mi.course_model_path(), tmp_path / "copy")
    assert mi.load_tokenizer(tmp_path / "copy")("x = 1").input_ids == mi.load_tokenizer()("x = 1").input_ids


def test_mismatched_packed_tensor_names_its_pieces(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.ones(20, 72)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(mi.CheckpointError, match=r"q_proj.weight \+ .*k_proj.weight \+ .*v_proj.weight "
                                                 r"has shape \(72, 72\) \+ \(20, 72\) \+ \(24, 72\)"):
        mi.load_model(folder)


def test_packing_goes_through_the_linear_layers_load_weight(hf_checkpoint, monkeypatch):
    """The one loading hook (what sharding and quantization will override): a packed projection's
    load_weight receives the checkpoint's matrices in the model's packed_modules_mapping order."""
    _, folder, hf = hf_checkpoint
    seen, load = [], mi.model.transformer.Linear.load_weight

    def spy(self, name, tensors):
        seen.append((name, [t.get_shape()[0] for t in tensors]))
        return load(self, name, tensors)

    monkeypatch.setattr(mi.model.transformer.Linear, "load_weight", spy)
    mi.load_model(folder)
    cfg, layers = hf.config, hf.config.num_hidden_layers
    q, kv = cfg.num_attention_heads * hf.model.layers[0].self_attn.head_dim, \
        cfg.num_key_value_heads * hf.model.layers[0].self_attn.head_dim
    assert seen.count(("weight", [q, kv, kv])) == layers
    assert seen.count(("weight", [cfg.intermediate_size] * 2)) == layers
