import pytest

# A two-block Llama-style model small enough for end-to-end tests in milliseconds.
TINY_LLAMA = dict(name="tiny-llama", family="llama", layers=3, hidden=64, ffn=176, heads=8, kv_heads=4, vocab=1000)
TINY_GPT = dict(name="tiny-gpt", family="gpt", layers=3, hidden=64, ffn=256, heads=4, vocab=1000, max_positions=128)


@pytest.fixture
def tiny_llama():
    return dict(TINY_LLAMA)


@pytest.fixture
def tiny_gpt():
    return dict(TINY_GPT)
