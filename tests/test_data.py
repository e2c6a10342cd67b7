import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pandas as pd
import pytest
import torch

from hybridflow.data.dataset import DataError, RLDataset, SFTDataset, collate_rl, collate_sft, load_rows
from hybridflow.data.tasks import main_make_data, make_addition_task, write_parquet
from hybridflow.models.tiny import build_char_tokenizer

PROMPT_LEN = 23  # chat-templated "a+b=" prompt with the char tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_addition_task(tmp_path_factory.mktemp("task"), seed=0)


def rl_row(content="1+2=", gt="3", **kw):
    row = {
        "data_source": "arith_add",
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"index": 0},
    }
    row.update(kw)
    return row


# ----------------------------------------------------------------------------------- task files
def test_task_rl_schema_and_split(task):
    train = pd.read_parquet(task["train"])
    val = pd.read_parquet(task["val"])
    assert len(val) == 25 and len(train) == 75
    for df, split in ((train, "train"), (val, "val")):
        assert set(df.columns) >= {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert (df["data_source"] == "arith_add").all() and (df["ability"] == "math").all()
        for _, r in df.iterrows():
            ei = r["extra_info"]
            a, b = ei["a"], ei["b"]
            assert ei["split"] == split
            assert list(r["prompt"]) == [{"role": "user", "content": f"{a}+{b}="}]
            assert r["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
        assert sorted(df["extra_info"].map(lambda e: e["index"])) == list(range(len(df)))
    pairs_t = {(e["a"], e["b"]) for e in train["extra_info"]}
    pairs_v = {(e["a"], e["b"]) for e in val["extra_info"]}
    assert not pairs_t & pairs_v
    assert pairs_t | pairs_v == {(a, b) for a in range(10) for b in range(10)}


def test_task_sft_bias(task):
    sft = pd.read_parquet(task["sft"])
    assert len(sft) == 800 and set(sft.columns) == {"prompt", "response"}
    wrong = 0
    pairs = set()
    for _, r in sft.iterrows():
        a, b = map(int, r["prompt"][0]["content"].rstrip("=").split("+"))
        pairs.add((a, b))
        ans = int(r["response"])
        assert ans in (a + b, a + b + 1)
        wrong += ans != a + b
    assert len(pairs) == 100
    assert abs(wrong / len(sft) - 0.75) < 0.06


def test_task_seeded_and_cli(tmp_path, task):
    other = make_addition_task(tmp_path / "a", seed=0, bias_prob=0.0, sft_copies=1, val_fraction=0.5)
    sft = pd.read_parquet(other["sft"])
    assert len(sft) == 100
    assert all(int(r["response"]) == eval(r["prompt"][0]["content"][:-1]) for _, r in sft.iterrows())
    assert len(pd.read_parquet(other["val"])) == 50
    assert main_make_data([str(tmp_path / "b"), "--task", "arith_add", "--seed", "0"]) == 0
    assert pd.read_parquet(tmp_path / "b" / "val.parquet").equals(pd.read_parquet(task["val"]))


# ------------------------------------------------------------------------------------ RLDataset
def test_rl_dataset_items(task, tok):
    ds = RLDataset([str(task["train"])], tok, max_prompt_length=32)
    assert len(ds) == 75 and ds.num_filtered == 0
    it = ds[3]
    assert it["index"] == 3
    chat = tok.apply_chat_template(it["raw_prompt"], add_generation_prompt=True, tokenize=False)
    assert it["input_ids"] == tok.encode(chat, add_special_tokens=False)
    assert len(it["input_ids"]) == PROMPT_LEN
    text = tok.decode(it["input_ids"])
    assert text.endswith("<|im_start|>assistant\n") and it["raw_prompt"][0]["content"] in text
    assert it["data_source"] == "arith_add" and "ground_truth" in it["reward_model"]
    assert it["extra_info"]["split"] == "train"


def test_rl_dataset_overlong(tmp_path, tok):
    f = str(write_parquet([rl_row("1+2="), rl_row("1+2=" + "x" * 10), rl_row("3+4=")], tmp_path / "p.parquet"))
    ds = RLDataset([f], tok, max_prompt_length=PROMPT_LEN)
    assert len(ds) == 2 and ds.num_filtered == 1
    assert [d["index"] for d in (ds[0], ds[1])] == [0, 1]
    full = tok.apply_chat_template(rl_row("1+2=" + "x" * 10)["prompt"], add_generation_prompt=True, tokenize=False)
    full_ids = tok.encode(full, add_special_tokens=False)
    left = RLDataset([f], tok, PROMPT_LEN, filter_overlong_prompts=False, truncation="left")
    assert len(left) == 3 and left.num_truncated == 1
    assert left[1]["input_ids"] == full_ids[-PROMPT_LEN:]
    right = RLDataset([f], tok, PROMPT_LEN, filter_overlong_prompts=False, truncation="right")
    assert right[1]["input_ids"] == full_ids[:PROMPT_LEN]
    with pytest.raises(DataError) as e:
        RLDataset([f], tok, PROMPT_LEN, filter_overlong_prompts=False, truncation="error")
    msg = str(e.value)
    assert f in msg and "row 1" in msg and str(PROMPT_LEN + 10) in msg and "data.max_prompt_length" in msg
    with pytest.raises(DataError, match="truncation"):
        RLDataset([f], tok, PROMPT_LEN, truncation="middle")


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"reward_model": None}, "'reward_model' is missing or null"),
        ({"data_source": None}, "'data_source' is missing or null"),
        ({"prompt": []}, "'prompt'"),
        ({"reward_model": {"style": "rule", "ground_truth": None}}, "ground_truth"),
    ],
)
def test_rl_dataset_bad_values(tmp_path, tok, bad, needle):
    rows = [rl_row() for _ in range(3)]
    rows[2].update(bad)
    f = str(write_parquet(rows, tmp_path / "bad.parquet"))
    with pytest.raises(DataError) as e:
        RLDataset([f], tok, 64)
    assert f in str(e.value) and "row 2" in str(e.value) and needle in str(e.value)


def test_rl_dataset_missing_column_and_file(tmp_path, tok):
    rows = [rl_row() for _ in range(2)]
    for r in rows:
        del r["reward_model"]
    f = str(write_parquet(rows, tmp_path / "nocol.parquet"))
    with pytest.raises(DataError) as e:
        RLDataset([f], tok, 64)
    assert f in str(e.value) and "row 0" in str(e.value) and "reward_model" in str(e.value)
    assert "ground_truth" in str(e.value)
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match="nope.parquet"):
        load_rows([missing])


def test_collate_rl_left_padding(tmp_path, tok):
    f = str(write_parquet([rl_row("1+2="), rl_row("11+22=", gt="33", extra_info=None)], tmp_path / "c.parquet"))
    ds = RLDataset([f], tok, 32)
    b = collate_rl([ds[0], ds[1]], tok.pad_token_id, 32)
    assert len(b) == 2
    ids, am, pos = b["input_ids"], b["attention_mask"], b["position_ids"]
    assert ids.shape == am.shape == pos.shape == (2, 32) and ids.dtype == am.dtype == torch.long
    for r, n in enumerate((PROMPT_LEN, PROMPT_LEN + 2)):
        assert am[r].tolist() == [0] * (32 - n) + [1] * n
        assert ids[r, 32 - n:].tolist() == ds[r]["input_ids"]
        assert (ids[r, : 32 - n] == tok.pad_token_id).all()
        assert pos[r].tolist() == [0] * (32 - n) + list(range(n))
    assert list(b["data_source"]) == ["arith_add", "arith_add"]
    assert b["reward_model"][1]["ground_truth"] == "33"
    assert b["extra_info"][0] == {"index": 0} and b["extra_info"][1] == {}
    assert list(b["index"]) == [0, 1]
    assert b["raw_prompt"][1] == [{"role": "user", "content": "11+22="}]


# ----------------------------------------------------------------------------------- SFTDataset
def test_sft_dataset_loss_mask(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": "3+5="}], "response": "8"},
            {"prompt": [{"role": "user", "content": "9+9="}], "response": "18"}]
    f = str(write_parquet(rows, tmp_path / "sft.parquet"))
    ds = SFTDataset([f], tok, max_length=32)
    assert len(ds) == 2
    for i, resp in enumerate(("8", "18")):
        it = ds[i]
        n_resp = len(resp) + 1  # + eos
        n = PROMPT_LEN + n_resp
        assert it["input_ids"].shape == (32,)
        assert it["attention_mask"].tolist() == [1] * n + [0] * (32 - n)
        assert it["loss_mask"].tolist() == [0] * PROMPT_LEN + [1] * n_resp + [0] * (32 - n)
        assert it["input_ids"][n - 1].item() == tok.eos_token_id
        assert tok.decode(it["input_ids"][PROMPT_LEN:n - 1].tolist()) == resp
        assert (it["input_ids"][n:] == tok.pad_token_id).all()
        assert it["position_ids"][:n].tolist() == list(range(n))
    b = collate_sft([ds[0], ds[1]])
    assert b["loss_mask"].shape == (2, 32) and b["loss_mask"].sum().item() == 2 + 3


def test_sft_dataset_truncation_and_errors(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "response": "123456789"}]
    f = str(write_parquet(rows, tmp_path / "long.parquet"))
    ds = SFTDataset([f], tok, max_length=PROMPT_LEN + 3)
    assert ds.num_truncated == 1
    it = ds[0]
    assert it["loss_mask"].tolist() == [0] * PROMPT_LEN + [1] * 3
    assert tok.decode(it["input_ids"][PROMPT_LEN:].tolist()) == "123"
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "response": "2"},
            {"prompt": [{"role": "user", "content": "1+1="}], "response": None}]
    f2 = str(write_parquet(rows, tmp_path / "nullresp.parquet"))
    with pytest.raises(DataError) as e:
        SFTDataset([f2], tok, 32)
    assert f2 in str(e.value) and "row 1" in str(e.value) and "'response'" in str(e.value)


def test_sft_task_file(task, tok):
    ds = SFTDataset([str(task["sft"])], tok, max_length=32)
    assert len(ds) == 800
    b = collate_sft([ds[i] for i in range(8)])
    lens = b["loss_mask"].sum(-1)
    assert ((lens >= 2) & (lens <= 3)).all()  # 1-2 digit answer + eos


# ------------------------------------------------------------------------------ digit_max task
from itertools import permutations  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402

from hybridflow.data.tasks import MAX_DATA_SOURCE, make_max_task  # noqa: E402
from hybridflow.rewards.scorers import compute_score  # noqa: E402


def _digits(prompt) -> tuple:
    content = prompt[0]["content"]
    assert content.startswith("max ")
    return tuple(int(d) for d in content[4:].split(" "))


@pytest.fixture(scope="module")
def max_task(tmp_path_factory):
    return make_max_task(tmp_path_factory.mktemp("max_task"), num_digits=3, seed=0)


def test_max_task_files_and_split(max_task):
    assert set(max_task) == {"train", "val", "sft", "pref_train", "pref_val"}
    assert all(p.exists() and p.suffix == ".parquet" for p in max_task.values())
    train = pd.read_parquet(max_task["train"])
    val = pd.read_parquet(max_task["val"])
    assert len(val) == 144 and len(train) == 576  # round(720 * 0.2)
    triples = {}
    for df, split in ((train, "train"), (val, "val")):
        assert (df["data_source"] == MAX_DATA_SOURCE).all() and (df["ability"] == "math").all()
        got = []
        for _, r in df.iterrows():
            d = _digits(r["prompt"])
            assert list(r["extra_info"]["digits"]) == list(d) and r["extra_info"]["split"] == split
            assert r["reward_model"] == {"style": "rule", "ground_truth": str(max(d))}
            got.append(d)
        assert sorted(df["extra_info"].map(lambda e: e["index"])) == list(range(len(df)))
        assert len(set(got)) == len(got)
        triples[split] = set(got)
    assert not triples["train"] & triples["val"]
    assert triples["train"] | triples["val"] == set(permutations(range(10), 3))


def test_max_task_sft_bias_and_holdout(max_task):
    sft = pd.read_parquet(max_task["sft"])
    val_triples = {_digits(p) for p in pd.read_parquet(max_task["val"])["prompt"]}
    train_triples = {_digits(p) for p in pd.read_parquet(max_task["train"])["prompt"]}
    assert len(sft) == 576 * 2 and set(sft.columns) == {"prompt", "response"}
    wrong = 0
    seen = set()
    for _, r in sft.iterrows():
        d = _digits(r["prompt"])
        seen.add(d)
        assert d not in val_triples
        ans = int(r["response"])
        assert ans in (min(d), max(d))
        wrong += ans == min(d)
    assert seen == train_triples
    assert abs(wrong / len(sft) - 0.75) < 0.05


def test_max_task_bias_prob_respected(tmp_path):
    files = make_max_task(tmp_path, bias_prob=0.3, sft_copies=1, seed=1)
    sft = pd.read_parquet(files["sft"])
    frac = sum(int(r["response"]) == min(_digits(r["prompt"])) for _, r in sft.iterrows()) / len(sft)
    assert abs(frac - 0.3) < 0.05
    with pytest.raises(ValueError, match="num_digits"):
        make_max_task(tmp_path / "bad", num_digits=11)


def test_max_task_rl_dataset_and_reward(max_task, tok):
    for split, n in (("train", 576), ("val", 144)):
        ds = RLDataset([str(max_task[split])], tok, max_prompt_length=32)
        assert len(ds) == n and ds.num_filtered == 0 and ds.num_truncated == 0
        it = ds[0]
        assert it["data_source"] == "digit_max"
        assert tok.decode(it["input_ids"]).endswith("<|im_start|>assistant\n")
    assert compute_score("digit_max", "8", "8")["score"] == 1.0
    assert compute_score("digit_max", "3", "8")["score"] == 0.0


def test_max_task_is_cli_default(tmp_path, max_task):
    assert main_make_data([str(tmp_path), "--seed", "0"]) == 0
    for split in ("train", "val", "sft"):
        # arrow tables: DataFrame.equals cannot compare the nested digit arrays in extra_info
        assert pq.read_table(tmp_path / f"{split}.parquet").equals(pq.read_table(max_task[split]))


def test_max_task_preference_pairs_prefer_the_maximum(max_task):
    """Chosen is the right rule's answer; rejected is another digit; pairs follow the RL split."""
    for name, rl in (("pref_train", "train"), ("pref_val", "val")):
        pairs, prompts = pd.read_parquet(max_task[name]), pd.read_parquet(max_task[rl])
        assert len(pairs) == 3 * len(prompts)
        assert {tuple(_digits(p)) for p in pairs["prompt"]} == {tuple(_digits(p)) for p in prompts["prompt"]}
        for _, r in pairs.iterrows():
            d = _digits(r["prompt"])
            assert r["chosen"] == str(max(d)) and r["rejected"] != r["chosen"] and r["rejected"].isdigit()


# ----------------------------------------------------------------------------------- code task
from hybridflow.data.tasks import CODE_DATA_SOURCE, code_answer, make_code_task  # noqa: E402


def test_code_task_is_digit_max_with_a_program_for_the_answer(tmp_path, max_task, tok):
    """The code recipe's task: digit_max's prompts and held-out split (same order), one assert per
    row for the sandboxed code reward, SFT programs over the train triples, the minimum's in ~75%;
    every row fits the recipe's lengths untruncated."""
    from hybridflow.demo import CODE_MAX_RESPONSE, CODE_SFT_MAX_LENGTH

    files = make_code_task(tmp_path, seed=0)
    assert set(files) == {"train", "val", "sft"}
    for split in ("train", "val"):
        rows, plain = pq.read_table(files[split]).to_pylist(), pq.read_table(max_task[split]).to_pylist()
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in plain]
        for r in rows:
            d = _digits(r["prompt"])
            assert r["data_source"] == CODE_DATA_SOURCE == "code" and r["extra_info"]["split"] == split
            assert r["reward_model"] == {"style": "rule", "ground_truth": [f"assert f() == {max(d)}"]}
        ds = RLDataset([str(files[split])], tok, max_prompt_length=32)
        assert len(ds) == len(rows) and ds.num_truncated == 0 and ds[0]["reward_model"]["ground_truth"] == rows[0]["reward_model"]["ground_truth"]
    train_triples = {_digits(r["prompt"]) for r in pq.read_table(files["train"]).to_pylist()}
    sft = pq.read_table(files["sft"]).to_pylist()
    assert {_digits(r["prompt"]) for r in sft} == train_triples and len(sft) == 2 * len(train_triples)
    wrong = 0
    for r in sft:
        d = _digits(r["prompt"])
        assert r["response"] in (code_answer(d, "max"), code_answer(d, "min"))
        wrong += r["response"] == code_answer(d, "min")
    assert abs(wrong / len(sft) - 0.75) < 0.05
    assert SFTDataset([str(files["sft"])], tok, max_length=CODE_SFT_MAX_LENGTH).num_truncated == 0
    assert len(tok(code_answer((9, 8, 7)))["input_ids"]) + 1 <= CODE_MAX_RESPONSE  # + eos
    # the reward the recipe trains with: the right rule's program passes its row's check, the wrong one's fails
    row = pq.read_table(files["val"]).to_pylist()[0]
    d, gt = _digits(row["prompt"]), row["reward_model"]["ground_truth"]
    assert compute_score("code", code_answer(d), gt)["score"] == 1.0
    assert compute_score("code", code_answer(d, "min"), gt)["score"] == 0.0
    with pytest.raises(ValueError, match="bias_prob"):
        make_code_task(tmp_path / "bad", bias_prob=2.0)
