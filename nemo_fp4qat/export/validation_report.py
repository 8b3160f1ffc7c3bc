"""What a validation found: problems named by tensor, the per-layer algorithms, numeric counts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Problem", "ValidationReport"]


@dataclass
class Problem:
    tensor: str
    message: str

    def __str__(self) -> str:
        return f"{self.tensor}: {self.message}"


@dataclass
class ValidationReport:
    path: str
    kind: str
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    runtime: str
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    layers: dict[str, str | None] = field(default_factory=dict)  # module -> algo (None: unquantized)
    numeric: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, tensor: str, message: str) -> None:
        self.errors.append(Problem(tensor, message))

    def format(self) -> str:
        head = (
            f"{self.path}: {self.kind} checkpoint, quant_algo={self.quant_algo}, kv_cache={self.kv_cache_quant_algo}, "
            f"{sum(a is not None for a in self.layers.values())} quantized / {len(self.layers)} linear layers"
        )
        lines = [head]
        lines += [f"  ERROR {p}" for p in self.errors]
        lines += [f"  warning {p}" for p in self.warnings]
        if self.numeric:
            counts = {k: v for k, v in self.numeric.items() if k != "layers_skipped"}
            lines.append(f"  numeric check: {json.dumps(counts)}")
            skipped = self.numeric.get("layers_skipped") or {}
            for reason in sorted(set(skipped.values())):
                n = sum(r == reason for r in skipped.values())
                lines.append(f"  numeric check skipped {n} layer(s): {reason}")
        lines.append("  OK" if self.ok else f"  FAILED ({len(self.errors)} errors)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d
