"""Two TensorRT-LLM checkpoints of the same training run at different parallel shapes, compared."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def assert_same_export(path, reference, layers: int, atol: dict[str, float] | None = None) -> None:
    """The export at ``path`` is validated code for code against the model it was written from (its
    ``validation.json``), holds every layer whole (tensor and pipeline size 1), and equals the one at ``reference``:
    every FP4 code the same, every scale and 16-bit tensor within one unit in the last place of its dtype (the
    runs agree to float32 summation order; one float32 ulp can round to neighbouring 16-bit values). ``atol``: an
    absolute tolerance for the tensors whose names end with a key (the caller says why)."""
    from safetensors.torch import load_file

    path, reference = Path(path), Path(reference)
    report = json.loads((path / "validation.json").read_text())
    assert report["ok"], report["errors"]
    assert report["numeric"]["layers_compared"] == layers and report["numeric"]["fp4_codes_different"] == 0, report
    config = json.loads((path / "config.json").read_text())
    assert config["mapping"]["tp_size"] == config["mapping"]["pp_size"] == 1
    a, b = load_file(str(reference / "rank0.safetensors")), load_file(str(path / "rank0.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        if a[key].dtype == torch.uint8:  # packed E2M1 codes
            assert torch.equal(a[key], b[key]), (key, int((a[key] != b[key]).sum()))
        else:
            rtol = max(1e-5, torch.finfo(a[key].dtype).eps)
            tol = next((t for end, t in (atol or {}).items() if key.endswith(end)), 1e-7)
            assert torch.allclose(a[key].float(), b[key].float(), rtol=rtol, atol=tol), key
