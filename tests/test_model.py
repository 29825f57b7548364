"""load_parameters: a state whose names differ from the model's parameters (a bogus key, a missing key,
a wrong shape) is refused with the offending names; a correct state from `parameter_state` (tied and
untied embeddings) loads and its values end up in the model."""

import dataclasses

import pytest
import torch

from ray_diloco.model import build_model, load_parameters, parameter_state
from ray_diloco.presets import tiny_cpu


def tiny_model(tie: bool, seed: int = 0):
    cfg = tiny_cpu().model
    return build_model(dataclasses.replace(cfg, tie_embeddings=tie), vocab_size=64, max_seq_len=16, seed=seed)


@pytest.mark.parametrize("tie", [True, False])
def test_correct_state_loads_its_values(tie):
    model = tiny_model(tie)
    state = parameter_state(tiny_model(tie, seed=1))
    assert ("lm_head.weight" in state) == (not tie)  # the tied head is the embedding, listed once
    load_parameters(model, state)
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name
    if tie:  # the head still shares the (new) embedding
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_bogus_key_is_refused():
    model = tiny_model(True)
    before = parameter_state(model)
    state = parameter_state(tiny_model(True, seed=1))
    state["model.layers.0.self_attn.q_proj.wieght"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected.*q_proj\.wieght"):
        load_parameters(model, state)
    # Nothing was copied: a refused state leaves the model as it was.
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_missing_key_is_refused():
    model = tiny_model(False)
    state = parameter_state(model)
    del state["lm_head.weight"]  # e.g. a tied model's state given to an untied model
    with pytest.raises(ValueError, match=r"missing.*lm_head\.weight"):
        load_parameters(model, state)


def test_wrong_shape_is_refused():
    model = tiny_model(True)
    state = parameter_state(model)
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_parameters(model, state)


def test_evaluator_refuses_a_misnamed_state():
    # The evaluator actor's class, used directly (no Ray): it loads θ through load_parameters.
    from ray_diloco.evaluator import EvaluatorImpl

    cfg = tiny_cpu()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=64))
    evaluator = EvaluatorImpl(cfg.to_dict(), torch.randint(0, 64, (2, 16)))
    state = parameter_state(evaluator.model)
    assert evaluator.evaluate(1, state)["eval_loss"] > 0
    state["model.embed_tokens.weight.bogus"] = state.pop("model.embed_tokens.weight")
    with pytest.raises(ValueError, match="embed_tokens"):
        evaluator.evaluate(2, state)
