"""The next-sentence multiple-choice set built from the demo book, and batched choice scoring."""

from __future__ import annotations

import pytest
import torch

from nemo_fp4qat.demo.model import load_corpus
from nemo_fp4qat.eval.evaluation import _has_kv_cache, _logits, choice_log_likelihoods
from nemo_fp4qat.eval.tasks import next_sentence_tasks, split_sentences

# core environment only: evaluation reads models through the plugin's own code, tested once


@pytest.fixture(scope="module")
def book():
    return load_corpus("persuasion")


def test_answer_is_the_sentence_that_follows_and_distractors_are_others(book):
    sents = split_sentences(book)
    tasks = next_sentence_tasks(book, n=50, seed=3)
    assert len(tasks) == 50
    for t in tasks:
        assert len(t["choices"]) == 4 and len(set(t["choices"])) == 4
        ctx = t["input"]
        k = next(i for i in range(len(sents)) if " ".join(sents[i : i + 3]) == ctx)
        assert t["choices"][t["answer"]] == " " + sents[k + 3]
        assert all(c.strip() in sents for c in t["choices"])
    positions = [t["answer"] for t in tasks]
    assert len(set(positions)) == 4  # the answer is not always in the same place


def test_tasks_are_deterministic_per_seed(book):
    assert next_sentence_tasks(book, n=20, seed=1) == next_sentence_tasks(book, n=20, seed=1)
    assert next_sentence_tasks(book, n=20, seed=1) != next_sentence_tasks(book, n=20, seed=2)


def test_short_text_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="usable sentences.*longer text"):
        next_sentence_tasks("One short sentence here. And another one here too.")


class WordTok:
    """Whitespace tokenizer over a fixed vocabulary (the interface `evaluation` uses)."""

    def __init__(self, words):
        self.vocab = {w: i for i, w in enumerate(sorted(set(words)))}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab[w] for w in text.split()]}


def test_batched_choice_scores_equal_one_at_a_time_scores():
    """Choices of different lengths are scored in one right-padded batch on the input's key/value cache;
    each score must equal scoring input + choice alone without a cache (float64 on a random tiny Llama)."""
    from tiny_models import tiny_llama

    model = tiny_llama(seed=0).double().eval()
    assert _has_kv_cache(model)  # the cached path is the one under test
    words = [f"w{i}" for i in range(40)]
    tok = WordTok(words)
    g = torch.Generator().manual_seed(0)

    def pick(n):
        return " ".join(words[int(i)] for i in torch.randint(0, 40, (n,), generator=g))

    for _ in range(5):
        task = {"input": pick(6), "choices": [pick(1), pick(3), pick(5)], "answer": 0}
        got = choice_log_likelihoods(model, tok, task)
        ctx = tok(task["input"])["input_ids"]
        for (total, count), choice in zip(got, task["choices"]):
            cont = tok(choice)["input_ids"]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = torch.log_softmax(_logits(model, ids)[0, :-1].double(), -1)
            alone = logp[torch.arange(len(ctx) - 1, len(ids[0]) - 1), ids[0, len(ctx) :]].sum()
            assert count == len(cont) and total == pytest.approx(float(alone), rel=1e-6, abs=1e-6)


def test_an_empty_input_is_scored_from_the_start_of_text_token():
    """BIG-bench-style sentence choice (no input): each choice is scored unconditionally, from the tokenizer's
    start-of-text token, as lm-evaluation-harness does; every token of a choice counts, on both scoring paths (a
    Hugging Face model's cache, a plain module), and equals scoring [bos] + choice by hand."""
    from tiny_models import tiny_llama

    tok = WordTok(["<s>", "the", "cat", "sat", "dog", "ran", "far"])
    tok.bos_token_id = tok.vocab["<s>"]
    model = tiny_llama(seed=0).double().eval()
    task = {"input": "", "choices": ["the cat sat", "dog ran far away"[:-5], "cat"], "answer": 0}
    got = choice_log_likelihoods(model, tok, task)
    plain = choice_log_likelihoods(_Plain(model), tok, task)
    for choice, (total, count), (total_plain, count_plain) in zip(task["choices"], got, plain, strict=True):
        ids = [tok.bos_token_id] + tok(choice)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(_logits(model, torch.tensor([ids])).double()[0], -1)
        want = float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        assert count == count_plain == len(ids) - 1
        assert total == pytest.approx(want, rel=1e-6) and total_plain == pytest.approx(want, rel=1e-6)
    tok.bos_token_id = None
    tok.eos_token_id = tok.vocab["far"]  # no start-of-text token: the end-of-text one, as lm-evaluation-harness
    assert choice_log_likelihoods(model, tok, task)[2][1] == 1


def test_a_task_that_cannot_be_scored_is_refused_with_the_fix():
    tok = WordTok(["a", "b"])
    from tiny_models import tiny_llama

    with pytest.raises(ValueError, match="no bos_token_id or eos_token_id.*give the task an input"):
        choice_log_likelihoods(tiny_llama(seed=0), tok, {"input": "", "choices": ["a"], "answer": 0})
    with pytest.raises(ValueError, match="drop the empty choice"):
        choice_log_likelihoods(tiny_llama(seed=0), tok, {"input": "a", "choices": ["", "b"], "answer": 1})


class _Plain(torch.nn.Module):
    """The same model without Hugging Face's cache interface: the right-padded batch path."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits
