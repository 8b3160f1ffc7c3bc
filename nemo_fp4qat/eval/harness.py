"""Task scores with lm-evaluation-harness, on a model in memory or on an export as deployed.

lm-evaluation-harness (``lm_eval``) is what users and modelopt's own examples score quantized models with, and its
results JSON is what dashboards read, so task scores go through it: :func:`run_lm_eval` hands the model (any
Hugging Face causal LM object, e.g. the one :func:`~nemo_fp4qat.export.deployed_model.load_deployed_model` rebuilds
from an export's codes and scales) to lm-eval's ``HFLM`` and calls ``simple_evaluate``.

Two tasks ship with the plugin so that everything runs offline on held-out text (the command line uses the demo's
embedded book; :func:`write_local_tasks` writes their data and lm-eval task YAMLs):

* ``fp4qat_next_sentence``: multiple choice, the sentence that really follows a context in the held-out book
  (:func:`~nemo_fp4qat.eval.tasks.next_sentence_tasks`); metrics ``acc`` and ``acc_norm`` (lm-eval's: per byte);
* ``fp4qat_heldout_perplexity``: rolling log-likelihood of held-out passages; ``word_perplexity``,
  ``byte_perplexity``, ``bits_per_byte``.

Standard tasks (``hellaswag``, ``mmlu``, ``gsm8k`` ...) are taken by name where their data is reachable.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["LOCAL_TASKS", "document_scores", "lm_eval_table", "run_lm_eval", "write_local_tasks"]

LOCAL_TASKS = ("fp4qat_next_sentence", "fp4qat_heldout_perplexity")

_MC_YAML = """task: fp4qat_next_sentence
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{input}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_PPL_YAML = """task: fp4qat_heldout_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def write_local_tasks(
    directory: str | Path, text: str, n_mc: int = 100, n_passages: int = 8, passage_words: int = 200
) -> Path:
    """Write the shipped tasks' data, made from the held-out ``text`` (the demo's: ``load_corpus("persuasion")``),
    and lm-eval task YAMLs into ``directory`` (returned; give it to :func:`run_lm_eval` as ``include_path``).
    Deterministic."""
    from .tasks import next_sentence_tasks

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    mc = out / "fp4qat_next_sentence.jsonl"
    mc.write_text("".join(json.dumps(t) + "\n" for t in next_sentence_tasks(text, n=n_mc)))
    words = text.split()
    step = max(passage_words, len(words) // max(1, n_passages))
    passages = [" ".join(words[i : i + passage_words]) for i in range(0, len(words), step)][:n_passages]
    ppl = out / "fp4qat_heldout_perplexity.jsonl"
    ppl.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages))
    (out / "fp4qat_next_sentence.yaml").write_text(_MC_YAML.format(data=json.dumps(str(mc.resolve()))))
    (out / "fp4qat_heldout_perplexity.yaml").write_text(_PPL_YAML.format(data=json.dumps(str(ppl.resolve()))))
    return out


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    tasks: list[str],
    include_path: str | Path | list[str | Path] | None = None,
    limit: int | float | None = None,
    batch_size: int = 1,
    output: str | Path | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-evaluation-harness's ``simple_evaluate`` on ``model`` (a Hugging Face causal LM object). Returns its
    results dict and, with ``output``, writes it there as lm-eval's results JSON (``samples`` left out).

    Args:
        tasks: lm-eval task names; the shipped local ones need ``include_path`` (:func:`write_local_tasks`).
        include_path: a directory of task YAMLs, searched before lm-eval's own tasks.
        limit: documents per task (an int) or a fraction of each task.
        log_samples: keep lm-eval's per-document records (``results["samples"]``; see :func:`document_scores`).

    Raises:
        ValueError: a task name lm-eval does not know (the message lists the names it was given).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    paths = include_path if isinstance(include_path, list) else [include_path] if include_path else []
    manager = _task_manager(tuple(str(Path(p).resolve()) for p in paths), tuple(tasks))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"lm-evaluation-harness knows no task {unknown}: give lm-eval task names (e.g. hellaswag, mmlu) or "
            f"a directory of task YAMLs (--tasks DIR); the shipped offline tasks are {list(LOCAL_TASKS)}."
        )
    model.eval()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                              log_samples=log_samples)  # fmt: skip
    if output is not None:
        from lm_eval.utils import handle_non_serializable

        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {k: v for k, v in results.items() if k != "samples"}
        path.write_text(json.dumps(kept, indent=2, default=handle_non_serializable))
    return results


@functools.lru_cache(maxsize=8)
def _task_manager(include_paths: tuple[str, ...], tasks: tuple[str, ...]) -> Any:
    """lm-eval's task index for ``tasks``: of ``include_paths`` alone when they hold every task, else with lm-eval's
    own tasks too. Kept per process: indexing lm-eval's thousands of task YAMLs costs seconds every time, and the
    demo scores five variants on the same tasks (the YAMLs are read again by each ``simple_evaluate``)."""
    from lm_eval.tasks import TaskManager

    if include_paths:
        local = TaskManager(include_path=list(include_paths), include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    return TaskManager(include_path=list(include_paths) or None)


def document_scores(results: dict[str, Any], task: str, metric: str = "acc") -> list[float]:
    """One task's per-document ``metric`` from a :func:`run_lm_eval` run with ``log_samples=True``, in document
    order: what a paired comparison of two models on the same documents needs."""
    samples = (results.get("samples") or {}).get(task)
    if samples is None:
        raise ValueError(f"no per-document records of {task!r}: run run_lm_eval(..., log_samples=True)")
    return [float(s[metric]) for s in sorted(samples, key=lambda s: s["doc_id"])]


def lm_eval_table(results: dict[str, Any]) -> str:
    """lm-eval's own results table (what its command line prints)."""
    from lm_eval.utils import make_table

    return make_table(results)
