"""stg: symbolic tensor graphs to per-rank Chakra execution traces.

    from stg import load_model, Plan, generate
    model = load_model("llama3-8b")
    summary = generate(model, Plan(dp=8, global_batch=64, seq=4096), out="out/")
"""

from importlib import import_module

__version__ = "0.1.0"

# Imported on first use (PEP 562): model_zoo builds on stg's IR, and stg's API re-exports
# model_zoo's loader, so eager imports here would be circular.
_EXPORTS = {
    "load_model": "model_zoo",
    "Model": "model_zoo",
    "Plan": "stg.plan",
    "AttentionFlops": "stg.plan",
    "Workload": "stg.api",
    "build": "stg.api",
    "generate": "stg.api",
    "count": "stg.api",
    "evaluate": "stg.evaluation",  # stg/evaluate.py in DESIGN.md: a module named like the function would shadow it
    "explore": "stg.explore",  # stg.explore(model, Cluster(...), Job(...), Space(...))
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stg' has no attribute {name!r}")
