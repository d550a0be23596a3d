"""The example byte-level GPT: size, seeded bitwise-deterministic init, shapes, loss."""

from __future__ import annotations

import math

import pytest
import torch

from examples.gpt import GPT, GPTConfig

SMALL = GPTConfig(seq_len=32, n_layer=2, n_head=2, n_embd=32)


def test_default_size_is_two_to_three_million_parameters() -> None:
    n = GPT().num_params()
    assert 2_000_000 <= n <= 3_000_000
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.dropout) == (256, 0.0)


def test_embedding_is_tied() -> None:
    m = GPT(SMALL)
    assert m.lm_head.weight is m.wte.weight
    assert m.num_params() == sum(p.numel() for p in m.state_dict().values()) - m.wte.weight.numel()


def test_same_seed_same_bits_different_seed_different_bits() -> None:
    a, b, c = GPT(SMALL, seed=11), GPT(SMALL, seed=11), GPT(SMALL, seed=12)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.std() > 0:  # random weights (biases are zero, LayerNorm gains one)
            assert not torch.equal(pa, pc), name


def test_init_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    GPT(SMALL, seed=5)
    assert torch.equal(torch.rand(4), want)


def test_same_seed_same_loss_and_gradients() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (3, SMALL.seq_len), generator=g)
    y = torch.randint(0, 256, (3, SMALL.seq_len), generator=g)
    grads = []
    losses = []
    for _ in range(2):
        m = GPT(SMALL, seed=3)
        _, loss = m(x, y)
        assert loss is not None
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(p, q) for p, q in zip(*grads, strict=True))
    # near-uniform predictions at init: loss close to ln(256)
    assert abs(losses[0].item() - math.log(256)) < 0.2


def test_forward_shapes_and_loss_definition() -> None:
    m = GPT(SMALL, seed=0)
    x = torch.randint(0, 256, (2, 20))
    logits, loss = m(x)
    assert logits.shape == (2, 20, 256) and loss is None
    y = torch.randint(0, 256, (2, 20))
    logits, loss = m(x, y)
    assert loss is not None and loss.shape == ()
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    with pytest.raises(ValueError, match="longer than seq_len"):
        m(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_attention_is_causal() -> None:
    m = GPT(SMALL, seed=0)
    x = torch.randint(0, 256, (1, 16))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256
    a, _ = m(x)
    b, _ = m(x2)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_bad_config_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
