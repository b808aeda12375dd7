"""The output layer in chunks (tiderl.trainer.logits) against the whole logits: the same log-probabilities,
entropy and gradients, without a [B, T, V] tensor; a model that changes its logits runs whole."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tiderl.trainer import logits as chunk
from tiderl.trainer.grpo import token_entropy, token_logprobs

VOCAB = 300


def _model(seed: int = 0, tied: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).float()


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 17), generator=g)
    attention = torch.ones_like(ids)
    attention[2, 12:] = 0  # a padded row
    mask = (torch.rand((3, 16), generator=g) > 0.3).float() * attention[:, 1:]
    return ids, attention, mask


def _reference(model: Qwen2ForCausalLM, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor,
               temperature: float, banned: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    return (token_logprobs(logits, ids, temperature=temperature, banned=banned),
            token_entropy(logits, mask, temperature=temperature, banned=banned))


def _chunked(model: Qwen2ForCausalLM, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor | None,
             temperature: float, banned: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return chunk.output_logprobs(model, lambda: model(input_ids=ids, attention_mask=attention, use_cache=False),
                                 ids, temperature=temperature, banned=banned, loss_mask=mask)


@pytest.mark.parametrize(("temperature", "banned", "tied"), [(1.0, (), False), (0.7, (5, 17, 299), True)])
def test_chunks_give_the_whole_logits_values_and_gradients(monkeypatch, temperature, banned, tied) -> None:
    monkeypatch.setattr(chunk, "CHUNK_ELEMENTS", VOCAB * 5)  # 5 positions a chunk: 48 positions in 10 chunks
    ids, attention, mask = _batch()
    ref_model, model = _model(tied=tied), _model(tied=tied)
    lp_ref, ent_ref = _reference(ref_model, ids, attention, mask, temperature, banned)
    lp, ent = _chunked(model, ids, attention, mask, temperature, banned)
    assert ent is not None
    torch.testing.assert_close(lp, lp_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-6, rtol=1e-5)
    assert not ent.requires_grad and lp.requires_grad
    (lp_ref * mask).sum().backward()
    (lp * mask).sum().backward()
    for (name, p_ref), p in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert model.lm_head.forward.__func__ is torch.nn.Linear.forward  # the identity was only for that forward


def test_no_saved_or_live_tensor_holds_every_positions_logits(monkeypatch) -> None:
    monkeypatch.setattr(chunk, "CHUNK_ELEMENTS", VOCAB * 4)
    ids, attention, mask = _batch()
    model = _model()
    whole = ids.shape[0] * (ids.shape[1] - 1) * VOCAB
    largest: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        largest.append(t.numel() if t.shape[-1:] == (VOCAB,) else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = _chunked(model, ids, attention, mask, 1.0, ())
    assert largest and max(largest) <= VOCAB * 4, max(largest)  # only a chunk's logits, and only in recompute
    lp.sum().backward()  # the recompute gives the gradients
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    # the reference path does keep [B, T, V] logits for its backward: the check above can fail
    largest.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference(_model(), ids, attention, mask, 1.0, ())
    assert max(largest) >= whole


def test_a_model_that_changes_its_logits_is_run_whole() -> None:
    ids, attention, mask = _batch()
    model = _model()
    forward = model.forward

    calls = []

    def scaled(*args, **kwargs):  # a logit scale after the output layer (as Cohere's, or soft-capping)
        calls.append(1)
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled  # type: ignore[method-assign]
    lp, ent = _chunked(model, ids, attention, mask, 1.0, ())
    logits = scaled(input_ids=ids, attention_mask=attention, use_cache=False).logits
    torch.testing.assert_close(lp, token_logprobs(logits, ids))
    torch.testing.assert_close(ent, token_entropy(logits, mask))
    assert len(calls) == 3  # found out on its first call (two forwards), the reference's one
    again, _ = _chunked(model, ids, attention, mask, 1.0, ())
    assert len(calls) == 4 and torch.equal(again, lp)  # from then on one forward a call, whole


def test_no_gradient_and_no_mask_for_the_reference() -> None:
    ids, attention, mask = _batch()
    model = _model()
    with torch.no_grad():
        lp, ent = _chunked(model, ids, attention, None, 1.0, ())
        lp_ref, _ = _reference(model, ids, attention, mask, 1.0, ())
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, lp_ref, atol=1e-6, rtol=1e-5)


def test_chunk_positions_follow_the_vocabulary() -> None:
    assert chunk.chunk_tokens(152_064) == chunk.CHUNK_ELEMENTS // 152_064 >= 200
    assert chunk.chunk_tokens(10**12) == 1
