"""NeMo-Run: a YAML override adds the QAT callback to a recipe through NeMo-Run's own CLI parser,
and the Slurm example builds and dry-runs (sbatch script with the container and resources)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from megatron_utils import free_port
from paths import ROOT
from test_documented_commands import documented

pytestmark = pytest.mark.nemo


NEMO_COMMANDS = sorted({c.replace("/opt/nemo-fp4qat/", "") for _, c in documented("nemo llm") if "..." not in c})


def test_the_documented_nemo_run_commands_are_collected():
    assert {"nemo llm finetune --factory llama3_8b --yaml conf/nemo_run/fp4qat.yaml",
            "nemo llm finetune --yaml conf/nemo_run/llama3_8b_fp4qat.yaml"} <= set(NEMO_COMMANDS)  # fmt: skip


@pytest.mark.parametrize("documented_cmd", NEMO_COMMANDS)
def test_documented_nemo_run_command_runs_as_typed(tmp_path, documented_cmd):
    """Each `nemo llm ...` command README.md, the YAMLs' own comments, the examples and the Dockerfile
    show, typed into a shell (dry run). NeMo-Run 0.11 binds ``-y`` to ``--yes``, so the documents spell
    ``--yaml`` out."""
    nemo = Path(sys.executable).parent / "nemo"
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemo_run")}
    res = subprocess.run([str(nemo), *documented_cmd.split()[1:], "--dryrun", "--yes"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "NeMoFP4QATCallback" in out and "policy='trtllm_mixed'" in out, out[-4000:]


def test_yaml_override_adds_the_callback_through_nemo_runs_cli_parser():
    pytest.importorskip("nemo_run")
    from nemo.collections import llm
    from nemo_run.cli.api import _load_entrypoints
    from nemo_run.cli.lazy import LazyEntrypoint

    from nemo_fp4qat.nemo import NeMoFP4QATCallback

    eps = metadata.entry_points().select(group="nemo_run.cli")
    assert "fp4qat" in eps.names
    _load_entrypoints()  # what the `nemo` CLI does: registers the fp4qat factory through our entry point
    from nemo_fp4qat.nemo.run_factories import fp4qat

    recipe = LazyEntrypoint(llm.finetune, factory="llama32_1b", yaml=str(ROOT / "conf/nemo_run/fp4qat.yaml")).resolve()
    kinds = [c.__fn_or_cls__ for c in recipe.trainer.callbacks]
    assert kinds[0] is not NeMoFP4QATCallback and NeMoFP4QATCallback in kinds  # appended to the recipe's own
    qat = next(c for c in recipe.trainer.callbacks if c.__fn_or_cls__ is NeMoFP4QATCallback)
    assert (qat.policy, qat.schedule, qat.calibration) == ("trtllm_mixed", "progressive", 256)
    assert any(c.__fn_or_cls__.__name__ == "QuantizationMonitor" for c in recipe.trainer.callbacks)
    assert [c.__fn_or_cls__ for c in fp4qat(monitor_every_n_steps=0)] == [NeMoFP4QATCallback]  # no monitor


def test_slurm_example_dry_runs(tmp_path):
    pytest.importorskip("nemo_run")
    cmd = [sys.executable, str(ROOT / "examples/nemo_run_qat.py"), "--executor", "slurm", "--dryrun",
           "--account", "acct42", "--nodes", "2", "--gpus", "8", "--job-dir", str(tmp_path / "jobs")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for needle in ("#SBATCH --account=acct42", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "--container-image"):
        assert needle in out, needle


def test_full_llama_finetune_config_resolves():
    pytest.importorskip("nemo_run")
    from nemo.collections import llm
    from nemo_run.cli.api import _load_entrypoints
    from nemo_run.cli.lazy import LazyEntrypoint

    from nemo_fp4qat.nemo import NeMoFP4QATCallback

    _load_entrypoints()
    p = LazyEntrypoint(llm.finetune, yaml=str(ROOT / "conf/nemo_run/llama3_8b_fp4qat.yaml")).resolve()
    assert p.model.config.__fn_or_cls__ is llm.Llama3Config8B and p.peft is None
    assert (p.trainer.max_steps, p.optim.config.lr) == (2000, 1e-5)
    qat = next(c for c in p.trainer.callbacks if c.__fn_or_cls__ is NeMoFP4QATCallback)
    assert qat.policy == "trtllm_mixed" and qat.schedule == "progressive"


def test_recipe_with_qat_runs_through_local_executor_on_cpu(tmp_path, monkeypatch):
    """A NeMo recipe (shrunk to a tiny Llama) + ``with_fp4_qat`` launched by NeMo-Run's LocalExecutor in a
    process of its own, in CPU mode via ``on_cpu``: it trains, calibrates and switches to NVFP4."""
    run = pytest.importorskip("nemo_run")
    import nemo.lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.bytelevel_tokenizers import ByteLevelTokenizer
    from nemo_run import config as run_config

    from nemo_fp4qat.nemo import on_cpu, with_fp4_qat

    monkeypatch.setattr(run_config, "_NEMORUN_HOME", str(tmp_path / "nemo_run"))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # the executor runs `python`
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the job initialises torch.distributed: a port nobody holds
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    recipe = llm.llama32_1b.pretrain_recipe(name="qat", dir=str(tmp_path / "out"), num_nodes=1, num_gpus_per_node=1)
    recipe.model.config = run.Config(llm.LlamaConfig, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                     num_attention_heads=4, num_query_groups=2, seq_length=32)  # fmt: skip
    recipe.data = run.Config(llm.MockDataModule, seq_length=32, global_batch_size=2, micro_batch_size=2,
                             num_workers=0, pin_memory=False, tokenizer=run.Config(ByteLevelTokenizer))  # fmt: skip
    recipe.trainer.accelerator = "cpu"
    recipe.trainer.max_steps = 4
    recipe.trainer.limit_val_batches = 0
    recipe.trainer.strategy.ckpt_async_save = False
    recipe.trainer.plugins = run.Config(nl.MegatronMixedPrecision, precision="32")
    recipe.optim.config.bf16 = False
    recipe.optim.config.use_distributed_optimizer = False
    with_fp4_qat(recipe, schedule={"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}]},
                 calibration=4)  # fmt: skip
    run.run(on_cpu(recipe), executor=run.LocalExecutor(), name="qat-cpu")
    logs = "".join(p.read_text() for p in (tmp_path / "nemo_run" / "experiments").rglob("combined.log"))
    assert "Traceback" not in logs, logs[-5000:]
    assert "calibrated on 4 samples" in logs and "step 2: mlp fp8 -> nvfp4" in logs
    assert "`max_steps=4` reached" in logs
