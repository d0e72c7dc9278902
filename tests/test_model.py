"""The demo GPT: config validation, presets, weight tying, causality, init, dtypes."""

import math

import pytest
import torch

from distopt.train.model import GPT, MODEL_PRESETS, GPTConfig, gpt_config

SEQ_LEN = 32


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", SEQ_LEN, **overrides))


def expected_params(config: GPTConfig) -> int:
    """GPT parameter count from the architecture, the tied head counted once."""
    d, v, t = config.n_embd, config.vocab_size, config.seq_len
    attn = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
    block = attn + mlp + 2 * (2 * d)  # two LayerNorms
    return v * d + t * d + config.n_layer * block + 2 * d  # + final LayerNorm


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_head": 3}, "divisible by n_head"),
        ({"n_layer": 0}, "n_layer must be a positive int"),
        ({"seq_len": -1}, "seq_len must be a positive int"),
        ({"n_embd": 64.0}, "n_embd must be a positive int"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_config_validation(kwargs, match):
    base = {"seq_len": 16, "n_layer": 2, "n_head": 4, "n_embd": 64}
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**base, **kwargs})


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        GPTConfig(16, 2, 4, 64)  # type: ignore[misc]


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="choose one of medium, small, tiny"):
        gpt_config("huge", 128)


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("tiny", 0.1e6, 0.3e6), ("small", 2.5e6, 4e6), ("medium", 15e6, 25e6)],
)
def test_preset_sizes(name, low, high):
    config = gpt_config(name, 256)
    assert config.vocab_size == 256 and config.seq_len == 256
    assert {k: getattr(config, k) for k in MODEL_PRESETS[name]} == MODEL_PRESETS[name]
    n = GPT(config).num_params()
    assert n == expected_params(config)
    assert low <= n <= high


def test_tied_head_is_one_parameter():
    model = tiny_model()
    assert model.lm_head.weight is model.wte.weight
    params = list(model.parameters())
    assert sum(p is model.wte.weight for p in params) == 1
    all_named = list(model.named_parameters(remove_duplicate=False))
    assert {name for name, _ in all_named} >= {"wte.weight", "lm_head.weight"}
    total_with_duplicates = sum(p.numel() for _, p in all_named)
    assert model.num_params() == total_with_duplicates - model.wte.weight.numel()
    assert model.num_params() == expected_params(model.config)


def test_tied_weight_gets_both_gradients():
    model = tiny_model()
    idx = torch.randint(0, 256, (2, SEQ_LEN))
    _, loss = model(idx, torch.randint(0, 256, (2, SEQ_LEN)))
    loss.backward()
    grad = model.wte.weight.grad
    # Every row gets a head gradient (the softmax touches every vocab entry), not only the
    # embedding rows of tokens present in idx.
    assert grad is not None and (grad.abs().sum(dim=1) > 0).all()


def test_causality():
    model = tiny_model().eval()
    idx = torch.randint(0, 256, (2, SEQ_LEN))
    t = 10
    changed = idx.clone()
    changed[:, t + 1] = (idx[:, t + 1] + 1) % 256
    with torch.no_grad():
        logits, _ = model(idx)
        logits_changed, _ = model(changed)
    torch.testing.assert_close(logits_changed[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(logits_changed[:, t + 1], logits[:, t + 1])


def test_shorter_input_and_too_long_input():
    model = tiny_model().eval()
    logits, loss = model(torch.randint(0, 256, (3, 5)))
    assert logits.shape == (3, 5, 256) and loss is None
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        model(torch.zeros(1, SEQ_LEN + 1, dtype=torch.long))


def test_untrained_loss_near_uniform():
    model = tiny_model()
    idx = torch.randint(0, 256, (4, SEQ_LEN))
    targets = torch.randint(0, 256, (4, SEQ_LEN))
    _, loss = model(idx, targets)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.1


def test_init_is_determined_by_rng_state():
    a, b, c = tiny_model(seed=1), tiny_model(seed=1), tiny_model(seed=2)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_gpt2_init_scales():
    torch.manual_seed(0)
    model = GPT(gpt_config("small", 64))
    block = model.blocks[0]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.count_nonzero(block.mlp.c_fc.bias) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params(dtype):
    model = tiny_model().to(dtype)
    idx = torch.randint(0, 256, (2, SEQ_LEN))
    logits, loss = model(idx, torch.randint(0, 256, (2, SEQ_LEN)))
    assert logits.dtype == dtype
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(256)) < 0.2
    loss.backward()
    assert model.wte.weight.grad.dtype == dtype


def test_bf16_autocast_matches_fp32():
    model = tiny_model()
    idx = torch.randint(0, 256, (2, SEQ_LEN))
    targets = torch.randint(0, 256, (2, SEQ_LEN))
    _, loss_fp32 = model(idx, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, targets)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(loss_fp32.item(), abs=0.05)
    loss.backward()
    assert model.wte.weight.grad.dtype == torch.float32


def test_dropout_only_in_training():
    model = tiny_model(dropout=0.5)
    idx = torch.randint(0, 256, (2, SEQ_LEN))
    torch.manual_seed(0)
    train_a, _ = model(idx)
    train_b, _ = model(idx)
    assert not torch.equal(train_a, train_b)
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])
