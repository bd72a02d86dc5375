"""A model described from Python: the same structure as a `family: graph` YAML, as a dict.

    python examples/custom_model.py [OUT]
"""

import sys
from pathlib import Path

from stg import Plan, generate, load_model
from stg.chakra.validate import validate

LAYER_OPS = [
    "h = rmsnorm(x, norm)",
    "up = einsum(bsh,hf->bsf, h, w_up)",
    "act = gelu(up)",
    "down = einsum(bsf,fh->bsh, act, w_down)",
    "down = constrain(down, residual)",
    "x = add(x, down)",
]

MODEL = {
    "name": "mlp-only",
    "family": "graph",
    "dims": {"H": ["embed", 512], "F": ["mlp", 2048], "V": ["vocab", 8192]},
    "inputs": {"tokens": ["B", "S"], "labels": ["B", "S"]},
    "blocks": [
        {"name": "embed", "params": {"weight": ["V", "H"]},
         "ops": ["x = embedding(weight, tokens)", "x = constrain(x, residual)"]},
        {"name": "layers", "repeat": 4, "params": {"norm": ["H"], "w_up": ["H", "F"], "w_down": ["F", "H"]},
         "ops": LAYER_OPS},
        {"name": "head", "params": {"norm": ["H"], "weight": ["V", "H"]},
         "ops": ["x = rmsnorm(x, norm)", "logits = einsum(bsh,vh->bsv, x, weight)",
                 "loss = cross_entropy(logits, labels)"]},
    ],
}


def main(out: Path) -> None:
    model = load_model(MODEL)
    print(f"{model.name}: {model.params:,} parameters")
    generate(model, Plan(dp=2, tp=2, pp=2, global_batch=4, seq=128), out=out)
    problems = validate(out)
    print("valid" if not problems else "\n".join(map(str, problems)))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/custom-model"))
