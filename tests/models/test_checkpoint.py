from __future__ import annotations

import json

import pytest
import torch

from streamrec.errors import ModelError
from streamrec.models.checkpoint import load_checkpoint, model_version, save_checkpoint
from streamrec.models.config import HSTUConfig
from streamrec.models.hstu import HSTU
from streamrec.models.vocabulary import ItemVocabulary


def small(seed: int = 0) -> tuple[HSTU, ItemVocabulary]:
    vocab = ItemVocabulary([f"i{n}" for n in range(10)], num_oov_buckets=2)
    torch.manual_seed(seed)
    cfg = HSTUConfig(
        num_items=vocab.size,
        num_oov_buckets=2,
        d_model=8,
        num_heads=1,
        head_dim=4,
        max_seq_len=8,
        task_hidden=4,
    )
    return HSTU(cfg), vocab


def test_round_trip_keeps_weights_config_vocab_and_version(tmp_path) -> None:
    model, vocab = small()
    version = save_checkpoint(tmp_path / "m", model, vocab, {"model_name": "tiny"})
    ckpt = load_checkpoint(tmp_path / "m")
    assert ckpt.version == version == model_version(tmp_path / "m")
    assert len(version) == 12
    assert ckpt.config == model.config and ckpt.model_name == "tiny"
    assert ckpt.vocab.items == vocab.items
    for name, tensor in model.state_dict().items():
        assert torch.equal(ckpt.model.state_dict()[name], tensor), name
    assert not ckpt.model.training


def test_loaded_model_owns_its_tensors_and_buffers(tmp_path) -> None:
    """Built on the meta device and given the file's tensors: the buffers are real, the
    module computes as the saved one, and rewriting the file does not reach it."""
    model, vocab = small()
    save_checkpoint(tmp_path / "m", model, vocab)
    ckpt = load_checkpoint(tmp_path / "m", dtype="bfloat16")
    assert not any(t.is_meta for t in [*ckpt.model.parameters(), *ckpt.model.buffers()])
    assert torch.equal(ckpt.model.time_edges, model.time_edges)
    assert {p.dtype for p in ckpt.model.parameters()} == {torch.bfloat16}
    before = ckpt.model.item_emb.weight.detach().clone()
    save_checkpoint(tmp_path / "m", small(seed=1)[0], vocab)  # the file is rewritten
    assert torch.equal(ckpt.model.item_emb.weight.detach(), before)
    fp32 = load_checkpoint(tmp_path / "m")
    assert all(p.requires_grad for p in fp32.model.parameters())


def test_version_changes_with_weights_and_not_with_meta(tmp_path) -> None:
    model, vocab = small()
    v1 = save_checkpoint(tmp_path / "a", model, vocab, {"note": 1})
    v2 = save_checkpoint(tmp_path / "b", model, vocab, {"note": 2})
    assert v1 == v2
    with torch.no_grad():
        model.item_emb.weight[3, 0] += 1e-3
    assert save_checkpoint(tmp_path / "c", model, vocab) != v1
    model2, _ = small()
    assert save_checkpoint(tmp_path / "d", model2, vocab) == v1  # same seed, same bytes
    renamed = ItemVocabulary([f"j{n}" for n in range(10)], num_oov_buckets=2)
    assert save_checkpoint(tmp_path / "e", model2, renamed) != v1


def test_load_errors_name_path_and_field(tmp_path) -> None:
    model, vocab = small()
    with pytest.raises(ModelError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    save_checkpoint(tmp_path / "m", model, vocab)
    cfg_file = tmp_path / "m" / "config.json"
    good = cfg_file.read_text()
    cfg_file.write_text(json.dumps({**json.loads(good), "num_heads": -1}))
    with pytest.raises(ModelError, match=r"config\.json.*num_heads=-1"):
        load_checkpoint(tmp_path / "m")
    cfg_file.write_text(json.dumps({**json.loads(good), "d_model": 16}))
    with pytest.raises(ModelError, match=r"weights\.safetensors.*shape"):
        load_checkpoint(tmp_path / "m")
    cfg_file.write_text(json.dumps({**json.loads(good), "dropout": 0.5}))
    with pytest.raises(ModelError, match="model_version"):
        load_checkpoint(tmp_path / "m")  # meta.json's version no longer matches
    with pytest.raises(ModelError, match="vocabulary"):
        save_checkpoint(tmp_path / "x", model, ItemVocabulary(["a"], 2))
