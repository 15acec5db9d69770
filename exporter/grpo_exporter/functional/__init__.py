"""Pure torch metric math: tensors in, 0-d tensors (or readings of them) out.

No Prometheus, no host sync, fp32 (or wider) reductions, masked positions excluded before any arithmetic.
One module per signal-chain layer, plus grouping and exact selection helpers.
"""

from grpo_exporter.functional.reading import Reading

__all__ = ["Reading"]
