from __future__ import annotations

import hashlib

import numpy as np
import pytest

from streamrec.errors import ModelError
from streamrec.models.vocabulary import ItemVocabulary, oov_bucket


def test_layout_padding_oov_then_known_items() -> None:
    vocab = ItemVocabulary(["a", "b", "c"], num_oov_buckets=4)
    assert vocab.size == 1 + 4 + 3
    np.testing.assert_array_equal(vocab.lookup(["a", "c", "b"]), [5, 7, 6])
    assert vocab.lookup(["a"]).dtype == np.int64
    assert [vocab.external(i) for i in (0, 1, 5, 7)] == ["<pad>", "<oov:0>", "a", "c"]
    assert [vocab.is_retrievable(i) for i in (0, 1, 4, 5, 7, 8)] == [
        False,
        False,
        False,
        True,
        True,
        False,
    ]
    with pytest.raises(ModelError, match="row 99"):
        vocab.external(99)


def test_unknown_ids_hash_stably_into_oov_buckets() -> None:
    vocab = ItemVocabulary(["a"], num_oov_buckets=8)
    rows = vocab.lookup([f"new-{i}" for i in range(200)])
    assert ((rows >= 1) & (rows <= 8)).all()
    assert len(set(rows.tolist())) == 8  # spread over every bucket
    want = int.from_bytes(hashlib.blake2b(b"new-7", digest_size=8).digest(), "little") % 8
    assert oov_bucket("new-7", 8) == want
    assert rows[7] == 1 + want
    # Same answer from a fresh object (no per-process salt).
    assert ItemVocabulary(["a"], 8).lookup(["new-7"])[0] == rows[7]


def test_save_load_round_trip(tmp_path) -> None:
    vocab = ItemVocabulary.build(["x", "y", "x", "zé"], num_oov_buckets=3)
    assert vocab.items == ["x", "y", "zé"]
    vocab.save(tmp_path / "vocab.json")
    loaded = ItemVocabulary.load(tmp_path / "vocab.json")
    assert loaded.items == vocab.items and loaded.num_oov_buckets == 3
    np.testing.assert_array_equal(loaded.lookup(["zé", "q"]), vocab.lookup(["zé", "q"]))


def test_bad_input_names_the_value(tmp_path) -> None:
    with pytest.raises(ModelError, match="'a'"):
        ItemVocabulary(["a", "b", "a"])
    with pytest.raises(ModelError, match="num_oov_buckets=0"):
        ItemVocabulary(["a"], num_oov_buckets=0)
    (tmp_path / "v.json").write_text('{"items": []}')
    with pytest.raises(ModelError, match="num_oov_buckets"):
        ItemVocabulary.load(tmp_path / "v.json")
