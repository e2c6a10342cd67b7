"""Tests for hybridflow.protocol.Batch: every method, errors, pickling, pad/unpad."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch


def make(n: int = 4) -> Batch:
    # ids: [n, 2] with row i = [2i, 2i+1]; per-sample dicts and strings as non-tensors.
    return Batch.from_dict(
        tensors={"ids": torch.arange(2 * n).reshape(n, 2), "score": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
        meta={"temperature": 1.0},
    )


def rows(b: Batch) -> list[int]:
    return b["score"].long().tolist()


def test_from_dict_object_arrays_and_access() -> None:
    b = Batch.from_dict(
        tensors={"x": torch.zeros(2, 3)},
        non_tensors={"lists": [[1, 2], [3, 4]], "dicts": [{"a": 1}, {"b": 2}]},
    )
    # Lists of equal-length lists must stay a 1-D object array, not become [2, 2].
    assert b["lists"].shape == (2,) and b["lists"].dtype == object
    assert b["lists"][1] == [3, 4]
    assert b["dicts"][0] == {"a": 1}
    assert len(b) == 2 and "x" in b and "lists" in b and "nope" not in b
    assert b.keys() == ["x", "lists", "dicts"]
    assert len(Batch.from_dict()) == 0


def test_from_dict_length_mismatch_names_key() -> None:
    with pytest.raises(ValueError, match="'bad'"):
        Batch.from_dict(tensors={"x": torch.zeros(3)}, non_tensors={"bad": [1, 2]})
    with pytest.raises(ValueError, match="0-dim"):
        Batch.from_dict(tensors={"x": torch.tensor(1.0)})


def test_getitem_missing_lists_keys() -> None:
    with pytest.raises(KeyError, match="ids"):
        make()["missing"]


def test_setitem_routes_and_checks_length() -> None:
    b = make()
    b["adv"] = torch.ones(4, 2)
    b["tag"] = ["a", "b", "c", "d"]
    assert "adv" in b.tensors and "tag" in b.non_tensors
    assert b["tag"][2] == "c"
    with pytest.raises(ValueError, match="'adv2'"):
        b["adv2"] = torch.ones(3)
    # Replacing a non-tensor key with a tensor moves it.
    b["tag"] = torch.zeros(4)
    assert "tag" in b.tensors and "tag" not in b.non_tensors
    empty = Batch.from_dict()
    empty["x"] = torch.zeros(5)
    assert len(empty) == 5


def test_chunk_and_error() -> None:
    parts = make(4).chunk(2)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3]]
    assert parts[1]["uid"].tolist() == ["u2", "u3"]
    assert parts[0].meta == {"temperature": 1.0}
    with pytest.raises(ValueError, match="pad_to_multiple"):
        make(5).chunk(2)


def test_split_last_smaller() -> None:
    parts = make(5).split(2)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4]]
    assert parts[2]["info"][0] == {"i": 4}


def test_concat_roundtrip_and_meta_from_first() -> None:
    b = make(6)
    parts = b.split(4)
    parts[1].meta["temperature"] = 0.5
    c = Batch.concat(parts)
    assert torch.equal(c["ids"], b["ids"]) and c["uid"].tolist() == b["uid"].tolist()
    assert c.meta["temperature"] == 1.0
    with pytest.raises(ValueError, match="key mismatch"):
        Batch.concat([b, b.select(["ids"])])


def test_repeat_interleave_and_tile() -> None:
    b = make(2)
    r = b.repeat(2, interleave=True)
    assert rows(r) == [0, 0, 1, 1]
    assert r["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert r["ids"].tolist() == [[0, 1], [0, 1], [2, 3], [2, 3]]
    t = b.repeat(2, interleave=False)
    assert rows(t) == [0, 1, 0, 1]
    assert t["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert t["ids"].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_select_and_pop() -> None:
    b = make()
    s = b.select(["ids", "uid"])
    assert s.keys() == ["ids", "uid"] and s.meta == b.meta
    assert b.select().keys() == b.keys()
    with pytest.raises(KeyError, match="nope"):
        b.select(["nope"])
    popped = b.pop(["score", "info"])
    assert popped.keys() == ["score", "info"]
    assert b.keys() == ["ids", "uid"]


def test_index_variants() -> None:
    b = make(4)
    assert rows(b.index([3, 1])) == [3, 1]
    assert rows(b.index(slice(1, 3))) == [1, 2]
    assert rows(b.index(torch.tensor([2, 0]))) == [2, 0]
    assert rows(b.index(torch.tensor([True, False, True, False]))) == [0, 2]
    assert rows(b.index(np.array([False, True, False, True]))) == [1, 3]
    assert rows(b.index(np.array([0, 0]))) == [0, 0]
    assert rows(b.index(2)) == [2]
    assert len(b.index([])) == 0
    picked = b.index([True, False, False, True])
    assert picked["uid"].tolist() == ["u0", "u3"] and picked["info"][1] == {"i": 3}
    with pytest.raises(ValueError, match="bool mask"):
        b.index(torch.tensor([True, False]))


def test_union_merges_and_checks_conflicts() -> None:
    b = make()
    other = Batch.from_dict(
        tensors={"ids": b["ids"].clone(), "adv": torch.ones(4)},
        non_tensors={"uid": [f"u{i}" for i in range(4)]},
        meta={"global_step": 3},
    )
    u = b.union(other)
    assert set(u.keys()) == {"ids", "score", "uid", "info", "adv"}
    assert u.meta == {"temperature": 1.0, "global_step": 3}
    bad = Batch.from_dict(tensors={"ids": b["ids"] + 1})
    with pytest.raises(ValueError, match="'ids'"):
        b.union(bad)
    bad_nt = Batch.from_dict(non_tensors={"uid": ["x"] * 4})
    with pytest.raises(ValueError, match="'uid'"):
        b.union(bad_nt)
    with pytest.raises(ValueError, match="lengths differ"):
        b.union(make(2))


def test_pad_unpad_inverse() -> None:
    b = make(5)
    padded, pad = b.pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    assert rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]  # copies of the first rows
    assert padded["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    parts = padded.chunk(4)
    back = Batch.concat(parts).unpad(pad)
    assert torch.equal(back["ids"], b["ids"]) and back["uid"].tolist() == b["uid"].tolist()
    same, zero = b.pad_to_multiple(5)
    assert zero == 0 and len(same) == 5 and len(same.unpad(0)) == 5
    # Cycling when more padding than rows: 2 rows -> multiple of 7.
    p2, n2 = make(2).pad_to_multiple(7)
    assert n2 == 5 and rows(p2) == [0, 1, 0, 1, 0, 1, 0]


def test_to_device() -> None:
    b = make().to("cpu")
    assert b["ids"].device.type == "cpu" and b.meta == {"temperature": 1.0}


def test_pickle_roundtrip_and_compact_views() -> None:
    b = make(4)
    c = pickle.loads(pickle.dumps(b))
    assert torch.equal(c["ids"], b["ids"]) and c["info"].tolist() == b["info"].tolist()
    assert c.meta == b.meta and c["uid"].dtype == object
    # A chunk is a view of the big tensor; pickling must send only its own rows.
    big = Batch.from_dict(tensors={"x": torch.zeros(1000, 100)})
    one_row = big.index(slice(0, 1))
    assert len(pickle.dumps(one_row)) < 10_000
    assert one_row.tensors["x"].untyped_storage().nbytes() == 1000 * 100 * 4  # original view kept
