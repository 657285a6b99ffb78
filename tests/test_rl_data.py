"""Real RL inputs: prompt data sets from JSONL / Parquet / datasets directories, and Hugging
Face tokenizers with chat templates (a tokenizer trained inside the test; nothing downloaded)."""

import json

import pytest

from quads_jax.rl.prompts import DatasetTask, PromptData, load_problems

ROWS = [{"q": f"What is {a} + {b}?", "ans": str(a + b), "sys": "Be brief." if a % 2 else ""}
        for a, b in zip(range(40), range(100, 140))]


def _write_all(tmp_path):
    j = tmp_path / "d.jsonl"
    j.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    import datasets
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "dsdir"))
    return [str(j), str(tmp_path / "d.parquet"), str(tmp_path / "dsdir")]


def test_every_format_gives_the_same_deterministic_split(tmp_path):
    splits = []
    for path in _write_all(tmp_path):
        cfg = PromptData(path=path, prompt_field="q", answer_field="ans", eval_n=8, seed=3, system_field="sys",
                         system_prompt="Default.")
        train, test, systems = load_problems(cfg)
        assert len(train) == 32 and len(test) == 8 and not {p.prompt for p in train} & {p.prompt for p in test}
        splits.append(([p.prompt for p in train], [p.answer for p in test], systems))
    assert splits[0] == splits[1] == splits[2]
    assert set(splits[0][2]) == {"Be brief.", "Default."}  # a row's own system prompt wins, else the default
    other = load_problems(PromptData(path=str(tmp_path / "d.jsonl"), prompt_field="q", answer_field="ans", eval_n=8, seed=4))
    assert [p.prompt for p in other[0]] != splits[0][0]


def test_dataset_task_scores_with_its_reward(tmp_path):
    path = _write_all(tmp_path)[0]
    task = DatasetTask(PromptData(path=path, prompt_field="q", answer_field="ans", eval_n=5, reward="math_verify"))
    p = task.split("test", 5)[0]
    assert task.reward(p, rf"so \boxed{{{p.answer}}}") == 1.0 and task.reward(p, r"\boxed{-1}") == 0.0
    assert len(task.split("test", 6)) == 5 and len(task.split("train", 10**6)) == 35  # caps, not errors


def test_clear_errors_for_bad_data(tmp_path):
    path = _write_all(tmp_path)[0]
    with pytest.raises(ValueError, match="no field 'question'"):
        load_problems(PromptData(path=path, prompt_field="question", answer_field="ans"))
    with pytest.raises(ValueError, match="eval_n"):
        load_problems(PromptData(path=path, prompt_field="q", answer_field="ans", eval_n=40))
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_problems(PromptData(path=str(tmp_path / "none.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_problems(PromptData(path=str(tmp_path / "bad.jsonl"), prompt_field="q"))


def make_hf_tokenizer(directory, lines):
    """A small BPE tokenizer trained on ``lines`` with ``tokenizers``, saved with special tokens
    and a chat template, as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tk.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    from tokenizers import decoders
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(str(directory))
    return str(directory)


def test_hf_tokenizer_applies_the_chat_template_and_stops_at_eos(tmp_path):
    from quads_jax.rl.hf_tokenizer import HFTokenizer

    lines = [f"What is {a} + {b}? The answer is {a + b}." for a in range(20) for b in range(20)]
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "tok", lines))
    ids = tok.prompt_ids("What is 2 + 3?", system="Be brief.")
    text = tok.tok.decode(ids)
    assert text == "<|system|>Be brief.</s><|user|>What is 2 + 3?</s><|assistant|>"
    assert tok.decode(tok.encode(" The answer is 5.") + [tok.eos_id] + tok.encode(" junk")) == " The answer is 5."
    assert tok.vocab_size <= 300 + 7 and tok.pad_id != tok.eos_id
    assert HFTokenizer(str(tmp_path / "tok"), chat_template=False).prompt_ids("hi")[0] == tok.bos_id
    with pytest.raises(FileNotFoundError):
        HFTokenizer(str(tmp_path / "none"))
