"""Subprocess worker for tests/nemo/test_nemo_import.py: imports the demo model into NeMo (megatron CPU
mode, its own process because NeMo's importer sets up torch.distributed), compares logits with the
Hugging Face model, then quantizes both with the same policy and compares those logits. Prints JSON."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

import torch


def counts(table) -> dict[str, int]:
    """How many modules of each (group, weight format, input format) the policy quantizes."""
    return dict(Counter(f"{r.group}:{r.weight}/{r.input}" for r in table.rows if r.quantized))


def main(cache: str) -> None:
    import os

    os.environ["NEMO_FP4QAT_CACHE"] = cache
    from nemo_fp4qat import QATController
    from nemo_fp4qat.demo.model import load_corpus, load_smollm2
    from nemo_fp4qat.nemo import megatron_cpu_mode, megatron_module
    from nemo_fp4qat.nemo.hf_import import load_nemo_model, megatron_logits, smollm2_nemo_checkpoint

    out: dict = {}
    t0 = time.time()
    path = smollm2_nemo_checkpoint()
    out["import_s"] = time.time() - t0
    stamp = (path / "weights" / "metadata.json").stat().st_mtime_ns
    t0 = time.time()
    assert smollm2_nemo_checkpoint() == path
    out["cached_s"] = time.time() - t0
    out["rewritten"] = (path / "weights" / "metadata.json").stat().st_mtime_ns != stamp

    hf, tok = load_smollm2()
    ids = tok(load_corpus("persuasion"))["input_ids"]
    tokens = torch.tensor(ids[:256]).view(2, 128)
    calib = [torch.tensor(ids[1000 + 128 * i : 1000 + 128 * (i + 1)]).view(1, 128) for i in range(4)]
    with torch.no_grad():
        ref = hf(tokens).logits
    with megatron_cpu_mode():
        nemo = load_nemo_model(path)
        got = megatron_logits(nemo, tokens)
        out["rel_err"] = float((got - ref).norm() / ref.norm())
        out["norm_weights_not_one"] = bool((megatron_module(nemo).decoder.layers[0].input_layernorm.weight != 1).any())

        # the same policy on both models: the policy must resolve NeMo's and HF's module names alike
        def mcore_fwd(m, b):
            return megatron_logits(nemo, b)

        qn = QATController(policy="default", forward_fn=mcore_fwd)
        out["nemo_table"] = counts(qn.prepare(megatron_module(nemo)))
        qn.calibrate(megatron_module(nemo), calib)
        # layer 0's quantized inputs, to compare with HF's below (the first layer sees the same fp32 inputs)
        seen: dict[str, torch.Tensor] = {}
        l0 = megatron_module(nemo).decoder.layers[0]
        pairs = {"qkv": l0.self_attention.linear_qkv, "proj": l0.self_attention.linear_proj,
                 "fc1": l0.mlp.linear_fc1, "fc2": l0.mlp.linear_fc2}  # fmt: skip
        hooks = [m.input_quantizer.register_forward_hook(lambda _m, _a, o, k=k: seen.setdefault(f"nemo_{k}", o))
                 for k, m in pairs.items()]  # fmt: skip
        got_q = megatron_logits(nemo, tokens)
        for h in hooks:
            h.remove()
        nemo_layers = megatron_module(nemo).decoder.layers
        layer = megatron_module(nemo).decoder.layers[0]
        fq = {
            "qkv": layer.self_attention.linear_qkv.weight_quantizer(layer.self_attention.linear_qkv.weight),
            "fc1": layer.mlp.linear_fc1.weight_quantizer(layer.mlp.linear_fc1.weight),
            "fc2": layer.mlp.linear_fc2.weight_quantizer(layer.mlp.linear_fc2.weight),
        }
        # the quantized NeMo model as a unified HF checkpoint in SmolLM2's own layout (the end-of-fit export's
        # kind='hf' on a NeMo run)
        from nemo_fp4qat.demo.model import smollm2_hf_dir
        from nemo_fp4qat.export import export_checkpoint

        exported = export_checkpoint(
            megatron_module(nemo), "hf_export", {"kind": "hf", "hf_model": str(smollm2_hf_dir())}
        )
        report = json.loads((exported / "validation.json").read_text())
        declared = json.loads((exported / "hf_quant_config.json").read_text())["quantization"]
        out["hf_export"] = {"ok": report["ok"], "numeric": report["numeric"], "quant_algo": declared["quant_algo"],
                            "layers": {k: v["quant_algo"] for k, v in declared.get("quantized_layers", {}).items()},
                            "exclude": declared.get("exclude_modules")}  # fmt: skip
    qh = QATController(policy="default", forward_fn=lambda m, b: m(b))
    out["hf_table"] = counts(qh.prepare(hf))
    qh.calibrate(hf, calib)
    h0 = hf.model.layers[0]
    pairs = {"qkv": h0.self_attn.q_proj, "proj": h0.self_attn.o_proj, "fc1": h0.mlp.gate_proj, "fc2": h0.mlp.down_proj}
    hooks = [m.input_quantizer.register_forward_hook(lambda _m, _a, o, k=k: seen.setdefault(f"hf_{k}", o))
             for k, m in pairs.items()]  # fmt: skip
    with torch.no_grad():
        ref_q = hf(tokens).logits
    for h in hooks:
        h.remove()
    # megatron activations are [seq, batch, hidden], HF's [batch, seq, hidden]
    out["layer0_quantized_input_max_diff"] = max(
        float((seen[f"nemo_{k}"].transpose(0, 1) - seen[f"hf_{k}"]).abs().max()) for k in pairs
    )
    # every quantizer's amax, NeMo's fused layer against its HF siblings, all layers
    rel = []
    for n, h in zip(nemo_layers, hf.model.layers, strict=True):
        for nm, hm in ((n.self_attention.linear_qkv, h.self_attn.q_proj),
                       (n.self_attention.linear_proj, h.self_attn.o_proj),
                       (n.mlp.linear_fc1, h.mlp.gate_proj), (n.mlp.linear_fc2, h.mlp.down_proj)):  # fmt: skip
            for q in ("input_quantizer", "weight_quantizer"):
                a, b = getattr(nm, q)._amax.float(), getattr(hm, q)._amax.float()
                rel.append(float(((a - b).abs() / b.abs().clamp(min=1e-12)).max()))
    out["amax_max_rel_diff"], out["amax_compared"] = max(rel), len(rel)
    h = hf.model.layers[0]
    names = ("gate_proj", "up_proj", "down_proj")
    wq = {n: getattr(h.mlp, n).weight_quantizer(getattr(h.mlp, n).weight) for n in names}
    # fused NeMo weights vs the HF siblings, fake-quantized: identical values when the policy gave both the
    # same formats and the HF siblings share their amax as fused layers must
    out["layer0_fc1_max_diff"] = float((fq["fc1"] - torch.cat([wq["gate_proj"], wq["up_proj"]])).abs().max())
    out["layer0_fc2_max_diff"] = float((fq["fc2"] - wq["down_proj"]).abs().max())
    out["layer0_fc1_changed"] = float((fq["fc1"] - layer.mlp.linear_fc1.weight).abs().max())

    def nll(logits) -> float:
        flat = logits[:, :-1].reshape(-1, logits.shape[-1])
        return float(torch.nn.functional.cross_entropy(flat, tokens[:, 1:].reshape(-1)))

    out["loss"] = {"hf": nll(ref), "nemo": nll(got), "hf_quant": nll(ref_q), "nemo_quant": nll(got_q)}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
