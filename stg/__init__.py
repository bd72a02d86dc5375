"""stg: symbolic tensor graphs to per-rank Chakra execution traces.

    from stg import load_model, Plan, generate
    model = load_model("llama3-8b")
    summary = generate(model, Plan(dp=8, global_batch=64, seq=4096), out="out/")
"""

from model_zoo import Model, load_model
from stg.api import Workload, __version__, build, generate
from stg.plan import AttentionFlops, Plan

__all__ = ["AttentionFlops", "Model", "Plan", "Workload", "__version__", "build", "generate", "load_model"]
