"""Config fuzzing: 1,000 random mutations of a valid config (wrong types, out-of-range values,
unknown keys, removed keys) give either a clear ConfigError or a config that validates."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from hybridflow.config import ConfigError, HybridFlowConfig, to_dict, validate_config
from hybridflow.config.loader import from_dict

BAD_VALUES = ["x", "", -1, 0, 1, 3, 2**40, -0.5, 1e9, math.nan, math.inf, None, True, [], ["a"], [1, 2], {}, {"k": 1}, 0.5]


@pytest.fixture
def valid(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "num_attention_heads": 4, "num_key_value_heads": 2}))
    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_text("")
    cfg = HybridFlowConfig()
    cfg.actor_rollout_ref.model.path = str(model)
    cfg.data.train_files, cfg.data.val_files = [str(tmp_path / "train.parquet")], [str(tmp_path / "val.parquet")]
    cfg.data.max_prompt_length, cfg.data.max_response_length = 32, 16
    cfg.actor_rollout_ref.rollout.n = 4
    validate_config(cfg)
    return to_dict(cfg)


def _leaves(tree: dict, prefix=()) -> list[tuple]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out += _leaves(v, prefix + (k,))
        else:
            out.append(prefix + (k,))
    return out


def _mutate(tree: dict, rng: random.Random) -> str:
    path = rng.choice(_leaves(tree))
    node = tree
    for k in path[:-1]:
        node = node[k]
    kind = rng.choice(["value", "value", "unknown", "remove"])
    key = ".".join(path)
    if kind == "value":
        node[path[-1]] = value = rng.choice(BAD_VALUES)
        return f"{key}={value!r}"
    if kind == "unknown":
        node[path[-1] + "_typo"] = 1
        return f"{key}_typo=1"
    del node[path[-1]]
    return f"del {key}"


def test_a_thousand_mutations_give_clear_errors_or_a_valid_config(valid):
    rng = random.Random(0)
    outcomes = {"config error": 0, "valid": 0}
    for i in range(1000):
        tree = json.loads(json.dumps(valid))
        changes = [_mutate(tree, rng) for _ in range(rng.choice([1, 1, 2, 3]))]
        try:
            validate_config(from_dict(HybridFlowConfig, tree), rng.choice(["rl", "dpo"]))  # hybridflow train / dpo
            outcomes["valid"] += 1
        except ConfigError as e:
            message = str(e)
            assert message and "Traceback" not in message, changes
            outcomes["config error"] += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"mutation {i} {changes} raised {type(e).__name__}: {e}")
    assert outcomes["config error"] > 500 and outcomes["valid"] > 50, outcomes


def _float_leaves(cls, prefix=()) -> list[tuple]:
    import dataclasses
    import typing

    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            out += _float_leaves(inner[0], prefix + (f.name,))
        elif inner[0] is float:
            out.append(prefix + (f.name,))
    return out


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_naming_the_key(valid, bad):
    """An oracle for the fuzz test's values: nan / inf in any float key is a config error that
    names the key (never a config that validates)."""
    leaves = _float_leaves(HybridFlowConfig)
    assert len(leaves) > 20
    for path in leaves:
        tree = json.loads(json.dumps(valid))
        node = tree
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = bad
        key = ".".join(path)
        with pytest.raises(ConfigError, match=re.escape(key)):
            validate_config(from_dict(HybridFlowConfig, tree))
