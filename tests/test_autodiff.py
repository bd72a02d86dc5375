import sympy

from model_zoo import load_model
from stg.autodiff import training_graph
from stg.graph import OpKind, Phase, Role


def test_backward_contractions_cost_twice_the_forward(tiny_gpt):
    model = load_model(tiny_gpt)
    train = training_graph(model.graph)

    def matmul(phases):
        return sympy.expand(sum(op.flops for op in train.ops if op.kind is OpKind.EINSUM and op.phase in phases))

    forward = matmul({Phase.FORWARD})
    assert sympy.expand(matmul({Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT}) - 2 * forward) == 0


def test_input_and_weight_gradients_are_separate_ops(tiny_llama):
    train = training_graph(load_model(tiny_llama).graph)
    w_ops = [op for op in train.ops if op.phase is Phase.BACKWARD_WEIGHT]
    b_ops = [op for op in train.ops if op.phase is Phase.BACKWARD_INPUT]
    assert w_ops and b_ops
    for op in w_ops:
        assert all(train.tensors[o].role is Role.GRADIENT for o in op.outputs)
    for op in b_ops:
        assert all(train.tensors[o].role is not Role.GRADIENT for o in op.outputs)


def test_every_weight_gets_one_optimizer_step(tiny_gpt):
    model = load_model(tiny_gpt)
    train = training_graph(model.graph)
    steps = [op for op in train.ops if op.kind is OpKind.OPTIMIZER]
    assert len(steps) == len(model.graph.weights)
    assert all(op.phase is Phase.STEP for op in steps)
    # AdamW: 15 FLOPs per parameter; reads a bf16 grad + 3 fp32 states, writes them and a bf16 weight
    params = model.graph.parameter_count()
    assert sympy.expand(sum(op.flops for op in steps) - 15 * params) == 0
    assert sympy.expand(sum(op.bytes for op in steps) - 28 * params) == 0


def test_tied_embedding_gradient_sums_both_uses(tiny_gpt):
    train = training_graph(load_model(tiny_gpt).graph)
    step = train.producer["embed.weight.next"]
    stored = train.producer[step.inputs[0]]
    assert stored.kind is OpKind.CONSTRAIN and stored.attrs["tag"] == "grad"
    adder = train.producer[stored.inputs[0]]
    assert adder.kind is OpKind.POINTWISE and adder.phase is Phase.BACKWARD_WEIGHT
    producers = {train.producer[i].kind for i in adder.inputs}
    assert producers == {OpKind.EINSUM, OpKind.EMBEDDING_GRAD}
