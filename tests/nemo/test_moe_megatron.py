"""megatron-core mixture-of-experts on the CPU (nemo env: megatron-core 0.15.3, modelopt 0.37): experts in NVFP4, the
router in 16 bits, expert parallelism on gloo. An EP 2 QAD run (each rank two of the four experts, the teacher a
frozen copy sharded like the student) equals the one-rank run step for step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

pytestmark = pytest.mark.nemo

STEPS = 4
SCHED = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}]}


def _tokens(seed: int, rank: int, world: int) -> torch.Tensor:
    """Each of the two data-parallel shards' 2 sequences; the one-rank run takes both shards in one batch."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randint(0, 96, (2, 17), generator=g) for _ in range(2)]
    return torch.cat(shards) if world == 1 else shards[rank]


def _worker(rank: int, world: int, init: str, folder: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from nemo_fp4qat import QATController
    from nemo_fp4qat.nemo import megatron_cpu_mode
    from nemo_fp4qat.qat.distillation.megatron import frozen_copy

    from megatron_utils import expert_rank_state, gpt_inputs, tiny_moe_gpt

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    result: dict = {"losses": []}
    with megatron_cpu_mode():
        model = tiny_moe_gpt(ep=world)
        if world == 1:
            torch.save(model.state_dict(), f"{folder}/base.pt")
        else:
            model.load_state_dict(expert_rank_state(torch.load(f"{folder}/base.pt"), rank, world))
        teacher = frozen_copy(model)  # QAD: the model before quantization, sharded like the student
        ctl = QATController(policy="default", schedule=SCHED, calibration=8, forward_fn=lambda m, b: m(*b))
        ctl.total_steps = STEPS
        table = ctl.prepare(model)
        result["table"] = {r.module: (r.group, r.weight) for r in table.rows if ".layers.0.mlp" in r.module}
        ctl.calibrate(model, [gpt_inputs(_tokens(100 + i, rank, world)[:, :-1]) for i in range(2)])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(STEPS):
            ctl.step(model, step)
            tokens = _tokens(step, rank, world)
            inputs = gpt_inputs(tokens[:, :-1])
            logits = model(*inputs)
            with torch.no_grad():
                target = teacher(*inputs)
            # QAD: KL(teacher || student) per token, averaged over every token of the global batch
            kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(target.float(), -1), log_target=True,
                          reduction="none").sum(-1)  # fmt: skip
            loss = kl.mean() / world  # this rank's share of the global mean
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:  # what megatron's DDP does: dense grads summed over data parallel, experts' over expert DP
                for name, p in model.named_parameters():
                    if ".local_experts." not in name and p.grad is not None:
                        dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
            opt.step()
            total = loss.detach().clone()
            if world > 1:
                dist.all_reduce(total)
            result["losses"].append(float(total))
        modules = dict(model.named_modules())
        amaxes = {n: getattr(m, "_amax", None) for n, m in modules.items() if n.endswith("_quantizer")}
        result["amax"] = {n: a.detach().clone() for n, a in amaxes.items() if isinstance(a, torch.Tensor)}
        result["state"] = {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
        result["formats"] = dict(ctl.current)
    out[rank] = result
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, tmp_path, tag: str) -> dict:
    ctx = mp.get_context("spawn")
    with mp.Manager() as manager:
        out = manager.dict()
        init = f"file://{tmp_path / f'store_{tag}'}"
        procs = [ctx.Process(target=_worker, args=(r, world, init, str(tmp_path), out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
                pytest.fail("a rank hung")
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return {r: out[r] for r in range(world)}


def _global(name: str, rank: int, per: int = 2) -> str:
    """A local expert's name on an expert-parallel rank -> its name in the one-rank model."""
    from nemo_fp4qat.qat.parallel.groups import global_expert_name

    return global_expert_name(name, rank * per)


@pytest.mark.slow
def test_expert_parallel_qad_equals_one_rank_step_for_step(tmp_path):
    pytest.importorskip("megatron.core")
    one = _spawn(1, tmp_path, "ep1")[0]
    two = _spawn(2, tmp_path, "ep2")

    table = one["table"]
    assert table["decoder.layers.0.mlp.router"] == ("router", "bf16")
    assert table["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1"] == ("experts", "nvfp4")
    assert table["decoder.layers.0.mlp.shared_experts.linear_fc2"] == ("shared_experts", "nvfp4")
    assert one["formats"]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2"] == ("nvfp4", "nvfp4")
    # every expert holds an amax, each projection's input amax is one value across all four experts (both ranks)
    for run in (one, two[0], two[1]):
        for layer in (0, 1):
            for proj in ("linear_fc1", "linear_fc2"):
                values = {float(v) for n, v in run["amax"].items()
                          if f"layers.{layer}.mlp.experts." in n and n.endswith(f"{proj}.input_quantizer")}  # fmt: skip
                assert len(values) == 1, (layer, proj, values)
    # EP 2 is the one-rank run: losses step for step, every amax and every weight (experts by global index)
    assert len(one["losses"]) == STEPS
    for r in (0, 1):
        assert two[r]["losses"] == pytest.approx(one["losses"], abs=1e-5)
        for name, value in two[r]["amax"].items():
            torch.testing.assert_close(value, one["amax"][_global(name, r)], rtol=0, atol=1e-6, msg=name)
        for name, value in two[r]["state"].items():
            torch.testing.assert_close(value, one["state"][_global(name, r)], rtol=0, atol=1e-5, msg=name)


def _model_with(experts: torch.nn.Module) -> torch.nn.Module:
    """A layer's names as megatron-core's GPT gives them: embedding, attention, router, the experts' container and
    the final norm."""
    layer = torch.nn.Module()
    layer.self_attention = torch.nn.Module()
    layer.self_attention.linear_qkv = torch.nn.Linear(16, 48)
    layer.mlp = torch.nn.Module()
    layer.mlp.router = torch.nn.Linear(16, 4)
    layer.mlp.experts = experts
    model = torch.nn.Module()
    model.embedding = torch.nn.Module()
    model.embedding.word_embeddings = torch.nn.Embedding(32, 16)
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    model.decoder.final_layernorm = torch.nn.LayerNorm(16)
    return model


@pytest.mark.parametrize("container", ["GroupedMLP", "TEGroupedMLP"])
def test_grouped_experts_are_refused_by_name_unless_the_policy_keeps_them_16_bit(container):
    """megatron-core's grouped experts (moe_grouped_gemm=True) are not one linear per expert: a policy that would
    quantize them is refused, naming the container and the fix; a rule keeping them in 16 bits lets the model on."""
    from megatron.core.transformer.moe import experts as mcore_experts

    from nemo_fp4qat import LayerPolicy
    from nemo_fp4qat.specs import ConfigError

    cls = getattr(mcore_experts, container)
    grouped = cls.__new__(cls)  # their construction needs grouped_gemm / Transformer Engine (CUDA); the class is real
    torch.nn.Module.__init__(grouped)
    grouped.weight1 = torch.nn.Parameter(torch.zeros(16, 4 * 32))  # every expert's fc1 side by side
    grouped.weight2 = torch.nn.Parameter(torch.zeros(4 * 32, 16))
    model = _model_with(grouped)
    with pytest.raises(ConfigError, match=rf"decoder\.layers\.0\.mlp\.experts \({container}\).*moe_grouped_gemm=False"):
        LayerPolicy.resolve_spec("default").resolve(model)
    rules = [{"patterns": ["*.mlp.experts*"], "weight": None, "group": "experts"},
             {"patterns": ["*.mlp.router"], "weight": None, "group": "router"},
             {"patterns": ["*linear_qkv"], "weight": "fp8", "group": "attention"}]  # fmt: skip
    keep = {"rules": rules, "default": None}
    table = LayerPolicy.resolve_spec(keep).resolve(model)
    assert [r.module for r in table.rows if r.quantized] == ["decoder.layers.0.self_attention.linear_qkv"]
