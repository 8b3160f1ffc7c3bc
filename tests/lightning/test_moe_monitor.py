"""QuantizationMonitor on a mixture-of-experts model: tokens per expert, dead experts, NaN/Inf in an expert's input."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest

from nemo_fp4qat import FP4QATCallback, QuantizationMonitor

from tiny_models import LitLM, loader, per_expert_linears, tiny_moe

pytestmark = pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models")


class RoutedTokens(pl.Callback):
    """Counts the tokens each router of the model sees from the start of training (after calibration)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module):
        for name, m in pl_module.net.named_modules():
            if name.endswith("mlp.gate"):

                def hook(module, args, output, _name=name):
                    self.tokens[_name] = self.tokens.get(_name, 0) + output.reshape(-1, output.shape[-1]).shape[0]

                m.register_forward_hook(hook)


@per_expert_linears
def test_the_monitor_counts_tokens_per_expert_names_a_dead_one_and_catches_inf_in_an_expert_input(tmp_path):
    model = tiny_moe("qwen3", seed=1)

    def never_expert_3(module, args, logits):  # layer 0's router never picks expert 3
        logits = logits.clone()
        logits[..., 3] = -1e4
        return logits

    model.model.layers[0].mlp.gate.register_forward_hook(never_expert_3)
    calls = {"n": 0}

    def inf_once(module, args):  # one Inf reaches expert 1's down_proj input in the third forward of training
        calls["n"] += 1
        if calls["n"] == 3 and args[0].numel():
            x = args[0].clone()
            x[0, 0] = float("inf")
            return (x,)

    qat = FP4QATCallback(policy="default", calibration=16, module_getter=lambda lit: lit.net)
    monitor = QuantizationMonitor(every_n_steps=2, out_dir=str(tmp_path), module_getter=lambda lit: lit.net)
    routed = RoutedTokens()

    class InjectAfterCalibration(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            model.model.layers[1].mlp.experts[1].down_proj.register_forward_pre_hook(inf_once)

    trainer = pl.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[qat, monitor, routed, InjectAfterCalibration()])  # fmt: skip
    trainer.fit(LitLM(model), loader(n=40, batch_size=8, seq_len=16))

    report = json.loads((tmp_path / "quant_report.json").read_text())
    # one window per measurement (the final one, right after the last step's, saw no forward)
    windows = [m["expert_tokens"] for m in report["measurements"] if "expert_tokens" in m]
    assert len(windows) == 3
    for router in ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate"):
        total = [sum(w[router][i] for w in windows) for i in range(4)]
        assert sum(total) == 2 * routed.tokens[router]  # top-2: every token reaches two experts
        assert (total[3] == 0) == router.startswith("model.layers.0")
    dead = {f["layer"] for f in report["findings"] if f["problem"] == "dead_expert"}
    assert dead == {"model.layers.0.mlp.experts.3"}
    nonfinite = [f for f in report["findings"] if f["problem"] == "nonfinite"]
    assert [f["layer"] for f in nonfinite] == ["model.layers.1.mlp.experts.1.down_proj"]
    assert nonfinite[0]["metric"] == "input_nonfinite"


@per_expert_linears
def test_a_dead_expert_rolls_its_experts_group_back():
    """action="rollback": a dead expert's finding names the expert, not a quantized linear; it rolls back the policy
    group its linears belong to."""
    model = tiny_moe("qwen3", seed=1)

    def never_expert_3(module, args, logits):
        logits = logits.clone()
        logits[..., 3] = -1e4
        return logits

    model.model.layers[0].mlp.gate.register_forward_hook(never_expert_3)
    qat = FP4QATCallback(policy="default", calibration=16, module_getter=lambda lit: lit.net)
    monitor = QuantizationMonitor(every_n_steps=2, action="rollback", module_getter=lambda lit: lit.net)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[qat, monitor])  # fmt: skip
    trainer.fit(LitLM(model), loader(n=16, batch_size=8, seq_len=16))
    assert {f.layer for f in monitor.findings if f.problem == "dead_expert"} == {"model.layers.0.mlp.experts.3"}
    assert set(qat.controller.pins) == {"experts"}


def _summed_worker(rank: int, init: str, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from nemo_fp4qat.monitor.experts import ExpertLoad, expert_load_findings

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        router = torch.nn.Linear(8, 4, bias=False)
        with torch.no_grad():
            router.weight.zero_()
            router.weight[rank * 2, :] = 1.0  # rank 0 routes every token to expert 0, rank 1 to expert 2 (top-1)
        model = torch.nn.Module()
        model.mlp = torch.nn.Module()
        model.mlp.gate, model.mlp.top_k = router, 1  # an MoE block's router and how many experts it picks
        load = ExpertLoad()
        assert load.attach(model) == 1
        router(torch.ones(5 + rank, 8))
        out[rank] = {"mine": load.snapshot(), "summed": load.summed(),
                     "dead": [f[0] for f in expert_load_findings(load.summed(), 0.1)]}  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.core_only  # core only: plain torch collectives over a router, no modelopt
def test_expert_token_counts_are_summed_over_the_ranks_before_an_expert_is_called_dead(tmp_path):
    """Each data-parallel rank routes its own tokens: an expert no token of one rank reached had the other's, so the
    counts are summed over the ranks before any expert is reported dead."""
    from two_ranks import run_two_ranks

    ranks = run_two_ranks(_summed_worker, f"file://{tmp_path / 'store'}")
    assert ranks[0]["mine"] == {"mlp.gate": [5, 0, 0, 0]} and ranks[1]["mine"] == {"mlp.gate": [0, 0, 6, 0]}
    for r in (0, 1):
        assert ranks[r]["summed"] == {"mlp.gate": [5, 0, 6, 0]}
        assert ranks[r]["dead"] == ["mlp.experts.1", "mlp.experts.3"]
