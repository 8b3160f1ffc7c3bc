"""lm-evaluation-harness as the task scorer (real lm-eval 0.4.13 on the real SmolLM2-135M, offline tasks)."""

from __future__ import annotations

import json

import pytest

from nemo_fp4qat.demo.model import load_corpus, load_smollm2
from nemo_fp4qat.eval.evaluation import choice_log_likelihoods, load_mc_tasks
from nemo_fp4qat.eval.gate import QualityGate
from nemo_fp4qat.eval.harness import LOCAL_TASKS, document_scores, run_lm_eval, write_local_tasks


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


def test_lm_eval_scores_the_shipped_next_sentence_task_as_the_plugins_scorer(tmp_path, smollm2):
    """On the same 8 documents lm-eval's ``acc`` equals the plugin's scorer's, and its ``acc_norm`` (log-likelihood
    per character of the choice) equals that normalisation applied to the plugin's per-choice log-likelihoods (the
    plugin's own ``acc_norm`` divides by tokens instead)."""
    model, tok = smollm2
    tasks_dir = write_local_tasks(tmp_path / "tasks", load_corpus("persuasion"))
    out = tmp_path / "lm_eval" / "results.json"
    res = run_lm_eval(model, tok, ["fp4qat_next_sentence"], include_path=tasks_dir, limit=8, batch_size=8, output=out,
                      log_samples=True)  # fmt: skip
    got = res["results"]["fp4qat_next_sentence"]
    docs = load_mc_tasks(tasks_dir / "fp4qat_next_sentence.jsonl")[:8]
    total, per_char = [], []
    for d in docs:
        ll = choice_log_likelihoods(model, tok, d)  # what the plugin's multiple_choice_accuracy ranks by
        total.append(max(range(len(ll)), key=lambda i: ll[i][0]) == d["answer"])
        per_char.append(max(range(len(ll)), key=lambda i: ll[i][0] / len(d["choices"][i])) == d["answer"])
    assert got["acc,none"] == pytest.approx(sum(total) / len(docs), abs=1e-12)
    assert got["acc_norm,none"] == pytest.approx(sum(per_char) / len(docs), abs=1e-12)
    # the per-document records a paired comparison reads, in document order
    assert document_scores(res, "fp4qat_next_sentence", "acc") == [float(t) for t in total]
    assert document_scores(res, "fp4qat_next_sentence", "acc_norm") == [float(t) for t in per_char]
    saved = json.loads(out.read_text())
    assert saved["results"]["fp4qat_next_sentence"]["acc,none"] == got["acc,none"] and "samples" not in saved


def test_shipped_perplexity_task_and_the_gate_on_lm_eval_metrics(tmp_path, smollm2):
    model, tok = smollm2
    tasks_dir = write_local_tasks(tmp_path / "tasks", load_corpus("persuasion"), n_passages=2, passage_words=60)
    res = run_lm_eval(model, tok, list(LOCAL_TASKS), include_path=tasks_dir, limit=4, batch_size=8)
    ppl = res["results"]["fp4qat_heldout_perplexity"]
    assert 1.0 < ppl["byte_perplexity,none"] < ppl["word_perplexity,none"]
    gate = QualityGate(max_ppl_increase_pct=0.5, max_acc_drop=1.0)
    assert gate.check_lm_eval(res, res).passed  # the model against itself
    worse = json.loads(json.dumps(res, default=str))
    worse["results"]["fp4qat_next_sentence"]["acc,none"] -= 0.25  # one of four documents lost
    worse["results"]["fp4qat_heldout_perplexity"]["word_perplexity,none"] *= 1.01
    verdict = gate.check_lm_eval(worse, res)
    assert not verdict.passed and len(verdict.failures) == 2
    assert verdict.checks["acc_drop_points"]["value"] == pytest.approx(25.0)
    assert "fp4qat_next_sentence/acc,none is 25.0 points below" in verdict.failures[0]


def test_unknown_task_is_refused_with_the_shipped_names(tmp_path, smollm2):
    with pytest.raises(ValueError, match=r"knows no task \['no_such_task'\].*fp4qat_next_sentence"):
        run_lm_eval(*smollm2, ["no_such_task"], include_path=write_local_tasks(tmp_path, load_corpus("persuasion")))


def test_the_task_index_is_built_once_and_holds_lm_evals_own_tasks_only_when_asked_for_one(tmp_path):
    """Indexing lm-eval's own task YAMLs costs seconds: a run that asks for the shipped tasks only indexes their
    folder, and a second run on the same folder and tasks reuses the index."""
    from nemo_fp4qat.eval.harness import _task_manager

    tasks = str(write_local_tasks(tmp_path, load_corpus("persuasion")).resolve())
    local = _task_manager((tasks,), ("fp4qat_next_sentence",))
    assert sorted(local.all_tasks) == sorted(LOCAL_TASKS)
    assert _task_manager((tasks,), ("fp4qat_next_sentence",)) is local
    both = _task_manager((tasks,), ("fp4qat_next_sentence", "hellaswag"))
    assert "hellaswag" in both.all_tasks and "fp4qat_next_sentence" in both.all_tasks
