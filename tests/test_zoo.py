"""Parameter counts against the published HuggingFace counts (../shared/reference/models.md)."""

import pytest

from model_zoo import load_model, zoo_names
from stg.errors import ModelSpecError

PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "gpt3-175b": 174_604_259_328,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_exact(name):
    assert load_model(name).params == PUBLISHED[name]


def test_zoo_lists_at_least_the_published_models():
    assert set(PUBLISHED) <= set(zoo_names())


def test_gpt2_small_matches_huggingface():
    # GPT-2 small as HuggingFace counts it: 124,439,808 (tied embeddings, 1024 positions)
    gpt2 = dict(name="gpt2", family="gpt", layers=12, hidden=768, ffn=3072, heads=12, vocab=50257, max_positions=1024)
    assert load_model(gpt2).params == 124_439_808


def test_model_from_yaml_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nfamily: llama\nlayers: 2\nhidden: 64\nffn: 128\nheads: 4\nvocab: 100\n")
    model = load_model(str(path))
    # 2 * V*H embed/head + L * (4 H^2 + 3 H F + 2 H) + H
    assert model.params == 2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden": -4}, "hidden: must be a positive integer"),
        ({"layers": 0}, "layers: must be a positive integer"),
        ({"heads": 6}, "heads=6 does not divide hidden=64"),
        ({"kv_heads": 3}, "kv_heads=3 does not divide heads=8"),
        ({"family": "rnn"}, "family must be one of"),
        ({"widht": 3}, "unknown field(s) ['widht']"),
        ({"vocab": None}, "missing field 'vocab'"),
        ({"norm": "batchnorm"}, "norm must be one of"),
    ],
)
def test_bad_model_is_a_clear_error(tiny_llama, change, message):
    with pytest.raises(ModelSpecError) as err:
        load_model({**tiny_llama, **change})
    assert message in str(err.value)


def test_unknown_model_and_bad_yaml(tmp_path):
    with pytest.raises(ModelSpecError, match="unknown model 'llama9'"):
        load_model("llama9")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ModelSpecError, match="not valid YAML"):
        load_model(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ModelSpecError, match="expected a mapping"):
        load_model(str(listy))


def test_megatron_1t_matches_narayanan_et_al():
    # Narayanan et al. 2021, section 5.1: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), which
    # counts every layer and the embeddings; the final LayerNorm (2h) is the rest (Table 1: 1008B)
    l, h, V, s = 128, 25600, 51200, 2048
    assert load_model("megatron-1t").params == 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h
