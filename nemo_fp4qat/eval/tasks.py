"""A multiple-choice set made from any text: pick the sentence that really comes next.

The demo corpus ships no multiple-choice benchmark (and the machines here cannot download one), so
the accuracy column of the evaluation is a next-sentence task built deterministically from the
held-out book: the context is a few consecutive sentences, the answer is the sentence that follows,
the distractors are sentences of similar length drawn from elsewhere in the same book. Chance is
``1 / choices``; a language model that follows the story scores well above it, and quantization
damage shows up as lost points. Tasks use the format :func:`~nemo_fp4qat.eval.evaluation.load_mc_tasks`
reads and :func:`~nemo_fp4qat.eval.evaluation.multiple_choice_accuracy` scores.
"""

from __future__ import annotations

import random
import re
from typing import Any

__all__ = ["next_sentence_tasks", "split_sentences"]

# Sentence ends: . ! ? (optionally followed by closing quotes) then whitespace. Hand-written because
# a tokenizer library (nltk/spacy) would be a heavy dependency for a split this simple.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\u201d\u2019]?\s+")


def split_sentences(text: str, min_words: int = 5, max_words: int = 40) -> list[str]:
    """Sentences of ``text`` (whitespace collapsed) with ``min_words``..``max_words`` words."""
    flat = " ".join(text.split())
    parts = [p.strip() for p in _SENTENCE_END.split(flat)]
    return [p for p in parts if min_words <= len(p.split()) <= max_words]


def next_sentence_tasks(
    text: str, n: int = 100, context_sentences: int = 3, choices: int = 4, seed: int = 0
) -> list[dict[str, Any]]:
    """``n`` tasks ``{"input", "choices", "answer"}``: which of ``choices`` sentences follows the context.

    Deterministic for a given text and seed. Distractors are the sentences closest in length to the
    answer among a random pool from the rest of the book, so length alone does not give it away.
    """
    if choices < 2:
        raise ValueError(f"choices must be >= 2, got {choices}")
    sents = split_sentences(text)
    need = context_sentences + 1 + 8 * choices
    if len(sents) < need:
        raise ValueError(
            f"The text has {len(sents)} usable sentences; {need} are needed for one task. Use a longer text."
        )
    rng = random.Random(seed)
    starts = list(range(len(sents) - context_sentences))
    rng.shuffle(starts)
    tasks = []
    for s in starts[:n]:
        answer = sents[s + context_sentences]
        taken = set(range(s, s + context_sentences + 1))
        pool = [i for i in rng.sample(range(len(sents)), 16 * choices) if i not in taken and sents[i] != answer]
        pool.sort(key=lambda i: abs(len(sents[i]) - len(answer)))
        options = [" " + answer] + [" " + sents[i] for i in pool[: choices - 1]]  # continuations: leading space
        order = list(range(choices))
        rng.shuffle(order)
        tasks.append(
            {
                "input": " ".join(sents[s : s + context_sentences]),
                "choices": [options[i] for i in order],
                "answer": order.index(0),
            }
        )
    return tasks
