import pytest
import sympy

from stg.builder import GraphBuilder
from stg.costs import NormKind, Pointwise
from stg.errors import GraphError
from stg.graph import DType, OpKind

B, S, H, F = sympy.symbols("B S H F", positive=True, integer=True)


def mlp():
    g = GraphBuilder()
    x = g.input("x", [B, S, H], ["batch", "seq", "embed"], DType.BF16)
    w1 = g.weight("w1", [H, F], ["embed", "mlp"])
    w2 = g.weight("w2", [F, H], ["mlp", "embed"])
    h = g.einsum("h", "bsh,hf->bsf", x, w1)
    a = g.pointwise("a", Pointwise.GELU, h)
    g.einsum("y", "bsf,fh->bsh", a, w2)
    return g.build()


def test_einsum_costs_twice_the_product_of_index_sizes():
    graph = mlp()
    assert graph.producer["h"].flops == 2 * B * S * H * F
    # bf16: read x and w1, write h
    assert graph.producer["h"].bytes == sympy.expand(2 * (B * S * H + H * F + B * S * F))
    assert graph.producer["a"].flops == Pointwise.GELU.forward_flops * B * S * F


def test_print_is_one_op_a_line_with_symbolic_shapes():
    text = str(mlp())
    assert text.splitlines() == [
        "%h: [B, S, F] bf16 = einsum[bsh,hf->bsf](%x, %w1)  # F flops=2*B*F*H*S",
        "%a: [B, S, F] bf16 = pointwise[gelu](%h)  # F flops=8*B*F*S",
        "%y: [B, S, H] bf16 = einsum[bsf,fh->bsh](%a, %w2)  # F flops=2*B*F*H*S",
    ]


def test_parameter_count_and_verify():
    graph = mlp()
    graph.verify()
    assert graph.parameter_count() == 2 * H * F


def test_einsum_operands_that_disagree_name_the_op_and_dims():
    g = GraphBuilder()
    x = g.input("x", [B, H], ["batch", "embed"], DType.BF16)
    w = g.weight("w", [F, H], ["mlp", "embed"])
    with pytest.raises(GraphError, match=r"op y: einsum index 'h' is H in one operand but F in w"):
        g.einsum("y", "bh,hf->bf", x, w)
    with pytest.raises(GraphError, match="has 3 indices but tensor x has shape"):
        g.einsum("z", "bsh,fh->bf", x, w)


def test_unused_weight_fails_verify():
    g = GraphBuilder()
    x = g.input("x", [B, H], ["batch", "embed"], DType.BF16)
    w = g.weight("w", [H, F], ["embed", "mlp"])
    g.weight("orphan", [H], ["embed"])
    g.einsum("y", "bh,hf->bf", x, w)
    with pytest.raises(GraphError, match="weight orphan .* is never used"):
        g.build().verify()


def test_broadcast_must_match_by_logical_axis():
    g = GraphBuilder()
    x = g.input("x", [B, H], ["batch", "embed"], DType.BF16)
    bias = g.weight("bias", [F], ["mlp"])
    with pytest.raises(GraphError, match="do not broadcast"):
        g.pointwise("y", Pointwise.ADD, x, bias)


def test_norm_and_softmax_costs_per_element():
    g = GraphBuilder()
    x = g.input("x", [B, H], ["batch", "embed"], DType.BF16)
    w = g.weight("w", [H], ["embed"])
    n = g.norm("n", NormKind.RMS_NORM, x, w)
    g.softmax("p", n)
    graph = g.build()
    assert graph.producer["n"].flops == 4 * B * H
    assert graph.producer["p"].flops == 5 * B * H
    assert graph.kinds()[OpKind.NORM] == 1


def _graph_fingerprint(graph) -> list:
    return ([(t.name, t.shape, t.dims, t.dtype, t.role, t.transient) for t in graph.tensors.values()] +
            [(op.name, op.kind, op.inputs, op.outputs, op.flops, op.bytes, op.phase, op.layer, op.attrs)
             for op in graph.ops])


@pytest.mark.parametrize("source", ["deepseek-v3", "gpt3-175b", "examples/llama3-8b-ops.yaml",
                                    "examples/parallel-block.yaml"])
def test_a_copied_layer_is_the_layer_built_op_by_op(source, monkeypatch):
    """The forward graph builds one layer of each kind and copies it for the others
    (GraphBuilder.add_copy): every tensor, op, cost, layer and attribute, in order, is what
    building each layer op by op makes (DeepSeek-V3: its dense and MoE layers; a described
    model's `repeat:` blocks)."""
    from pathlib import Path

    import model_zoo
    import model_zoo.described
    import model_zoo.transformer
    from model_zoo import GraphOptions, load_model

    root = Path(__file__).resolve().parent.parent
    model = load_model(str(root / source) if source.endswith(".yaml") else source)
    for options in (GraphOptions(), GraphOptions(False, None, True, False)):
        if options.fp8 and source.endswith(".yaml"):
            continue
        copies = []
        with monkeypatch.context() as m:
            add_copy = GraphBuilder.add_copy
            m.setattr(GraphBuilder, "add_copy", lambda self, *args: copies.append(add_copy(self, *args)))
            copied = model_zoo._forward_graph.__wrapped__(model.config, options)
        assert len(copies) >= 2
        with monkeypatch.context() as m:  # every layer built op by op
            m.setattr(model_zoo.transformer, "_layer_template", lambda *args: None)
            m.setattr(model_zoo.described._Builder, "template", lambda *args: None)
            built = model_zoo._forward_graph.__wrapped__(model.config, options)
        assert _graph_fingerprint(copied) == _graph_fingerprint(built)


def test_name_table_extend_places_names_as_at_does():
    """NameTable.extend (shapes put a layer's names into an action's table at once) gives each
    name the place at() would, one call per name in order: names already there keep theirs,
    a name twice in the list is placed once."""
    from stg.blocks import NameTable

    one, many = NameTable(), NameTable()
    for table in (one, many):
        table.at("x")
        table.at("w")
    names = ["a", "x", "b", "a", "c", "w", "d"]
    for name in names:
        one.at(name)
    many.extend(names)
    assert many.names == one.names == ["x", "w", "a", "b", "c", "d"]
    assert many.index == one.index == {"x": 0, "w": 1, "a": 2, "b": 3, "c": 4, "d": 5}


def test_consumers_list_each_reader_once_in_program_order():
    g = GraphBuilder()
    x = g.input("x", [B, S, H], ["batch", "seq", "embed"], DType.BF16)
    sq = g.pointwise("sq", Pointwise.MUL, x, x)  # reads x twice: one consumer
    y = g.pointwise("y", Pointwise.ADD, sq, x)
    g.pointwise("z", Pointwise.MUL, y, sq)
    graph = g.build()
    ops = {op.name: op for op in graph.ops}
    assert graph.consumers == {"x": (ops["sq"], ops["y"]), "sq": (ops["y"], ops["z"]), "y": (ops["z"],)}


def test_a_renamed_copy_keeps_everything_but_its_names():
    graph = mlp()
    op, tensor = graph.producer["h"], graph.tensors["h"]
    copy = op.renamed("h2", ("x", "w9"), ("h2",), 7, {"spec": "bsh,hf->bsf"})
    assert (copy.name, copy.inputs, copy.outputs, copy.layer) == ("h2", ("x", "w9"), ("h2",), 7)
    assert (copy.kind, copy.flops, copy.bytes, copy.phase) == (op.kind, op.flops, op.bytes, op.phase)
    assert (op.name, op.inputs, op.layer) == ("h", ("x", "w1"), 0)  # the original is untouched
    renamed = tensor.renamed("h2")
    assert renamed.name == "h2" and tensor.name == "h" and renamed.nbytes == tensor.nbytes
    assert renamed == type(tensor)("h2", tensor.shape, tensor.dims, tensor.dtype, tensor.role)
