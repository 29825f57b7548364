"""The inner AdamW after a non-finite step: its poisoned moments are forgotten, so a region that re-synced to
its peers' θ_global trains finite again instead of producing NaN and sitting out every later round."""

import torch

from ray_diloco.config import InnerOptConfig
from ray_diloco.inner import build_inner_optimizer, reset_nonfinite_state


def test_a_nan_gradient_poisons_adamw_until_its_state_is_reset():
    model = torch.nn.Linear(4, 3)
    optimizer, _ = build_inner_optimizer(model.parameters(), InnerOptConfig(lr=1e-2), total_steps=10,
                                          device=torch.device("cpu"))
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    model.bias.grad = torch.ones_like(model.bias)
    optimizer.step()
    assert not torch.isfinite(model.weight).all()

    def finite_step():
        with torch.no_grad():  # the peers' finite θ_global, as load_rows gives it
            model.weight.copy_(torch.ones_like(model.weight))
        model.weight.grad = torch.ones_like(model.weight)
        model.bias.grad = torch.ones_like(model.bias)
        optimizer.step()
        return torch.isfinite(model.weight).all()

    assert not finite_step()  # the moments still hold NaN: θ goes NaN again
    assert reset_nonfinite_state(optimizer) == 1  # the weight's state only; the bias's was finite
    assert model.bias in optimizer.state
    assert finite_step()
