"""A NeMo 2 recipe with ``with_fp4_qat`` builds (fiddle) into a trainer carrying the callback."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.nemo


def test_recipe_gets_the_callback_and_builds(tmp_path):
    pytest.importorskip("nemo.collections.llm")
    import fiddle as fdl
    from nemo.collections import llm

    from nemo_fp4qat import QuantizationMonitor
    from nemo_fp4qat.nemo import NeMoFP4QATCallback, with_fp4_qat

    recipe = llm.llama32_1b.finetune_recipe(name="qat", dir=str(tmp_path), num_nodes=1, num_gpus_per_node=1,
                                            peft_scheme=None)  # fmt: skip
    before = len(recipe.trainer.callbacks or [])
    with_fp4_qat(recipe, policy="trtllm_mixed", schedule="direct", calibration=128, monitor={"every_n_steps": 25})
    assert len(recipe.trainer.callbacks) == before + 2
    resume = fdl.build(recipe.resume)
    assert type(resume).__name__ == "QATAutoResume"
    assert resume.restore_config.path == "nemo://meta-llama/Llama-3.2-1B"  # the recipe's arguments kept
    recipe.trainer.accelerator = "cpu"  # recipes default to GPUs; this machine has none
    trainer = fdl.build(recipe.trainer)
    qat = [c for c in trainer.callbacks if isinstance(c, NeMoFP4QATCallback)]
    mon = [c for c in trainer.callbacks if isinstance(c, QuantizationMonitor)]
    assert len(qat) == 1 and len(mon) == 1 and mon[0].every_n_steps == 25
    assert qat[0].controller.policy.name == "trtllm_mixed" and qat[0].controller.calibration.num_samples == 128


def test_a_distillation_loss_but_kl_is_refused_by_the_nemo_callback_by_name():
    pytest.importorskip("nemo.collections.llm")
    from nemo_fp4qat.nemo import NeMoFP4QATCallback
    from nemo_fp4qat.specs import ConfigError

    with pytest.raises(ConfigError, match="distillation loss 'jsd' runs on the Lightning"):
        NeMoFP4QATCallback(policy="default", distillation={"loss": "jsd"})
    assert NeMoFP4QATCallback(policy="default", distillation={"loss": "kl"}).qad.loss == "kl"


def test_deploy_dtype_is_refused_on_nemo_by_name(tmp_path):
    """NeMo's megatron-core linears and embeddings are not covered by deploy_dtype's hooks: refused, in the callback
    and when a recipe is given it (before the job starts)."""
    pytest.importorskip("nemo.collections.llm")
    from nemo.collections import llm

    from nemo_fp4qat.nemo import NeMoFP4QATCallback, with_fp4_qat

    with pytest.raises(ValueError, match=r"deploy_dtype='float16' on a megatron-core model.*bfloat16"):
        NeMoFP4QATCallback(policy="default", deploy_dtype="float16")
    recipe = llm.llama32_1b.finetune_recipe(name="qat", dir=str(tmp_path), num_nodes=1, num_gpus_per_node=1,
                                            peft_scheme=None)  # fmt: skip
    with pytest.raises(ValueError, match="deploy_dtype='bfloat16' on a megatron-core model"):
        with_fp4_qat(recipe, policy="default", deploy_dtype="bfloat16")
