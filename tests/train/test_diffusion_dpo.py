"""Diffusion-DPO's flow-matching loss (spindle/train/objectives/diffusion_dpo.py) on a tiny Flux: both members
of a pair get the same noise and sigma through the family's own training inputs, and the loss and metrics equal
a direct computation with stock diffusers' FluxTransformer2DModel (flow_grpo's train_sd3_dpo.py, written out)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spindle.train.objectives.diffusion_dpo import diffusion_dpo_loss, pair_generators, per_sample_error
from tests.conftest import encode_two_samples

BETA = 500.0


@pytest.fixture(scope="module")
def condition(tiny_condition):
    return tiny_condition("flux")


def models(tiny_flux):
    """The reference (the starting weights) and a policy moved away from it."""
    from diffusers import FluxTransformer2DModel

    reference = FluxTransformer2DModel.from_pretrained(tiny_flux / "transformer").eval()
    policy = FluxTransformer2DModel.from_pretrained(tiny_flux / "transformer").eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return policy, reference


def test_diffusion_dpo_loss_equals_a_stock_diffusers_computation(condition, tiny_flux):
    from diffusers import FluxPipeline
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.utils.torch_utils import randn_tensor

    from spindle.train.tasks.flow_matching import sample_generator

    pack = lambda x: FluxPipeline._pack_latents(x, 2, x.shape[1], x.shape[2], x.shape[3])  # noqa: E731

    _, cond = encode_two_samples(condition, ["a red circle", "a blue square on the left"])
    # two pairs: (image 0 over image 1) for prompt 0, (image 1 over image 0) for prompt 1
    chosen = {**cond, "latents": cond["latents"]}
    rejected = {**cond, "latents": cond["latents"].flip(0)}
    gens_chosen, gens_rejected = pair_generators(sample_generator, 0, 5, [0, 1])
    inputs_c = condition.training_inputs(chosen, gens_chosen)
    inputs_r = condition.training_inputs(rejected, gens_rejected)
    sigmas = inputs_c.pop("sigmas")
    assert torch.equal(sigmas, inputs_r.pop("sigmas"))
    s = sigmas.view(-1, 1, 1)
    # the noise each sample's generator draws after its sigma (diffusers' training draws, as test_flux_train checks)
    gens = [sample_generator(0, 5, i) for i in (0, 1)]
    for g in gens:
        compute_density_for_timestep_sampling("uniform", 1, generator=g)
    noise = pack(randn_tensor(tuple(cond["latents"].shape), generator=gens))
    for inputs, x0 in ((inputs_c, chosen["latents"]), (inputs_r, rejected["latents"])):
        torch.testing.assert_close(inputs["hidden_states"], (1 - s) * pack(x0) + s * noise, rtol=0, atol=1e-6)
        torch.testing.assert_close(inputs["target"], noise - pack(x0), rtol=0, atol=1e-6)

    policy, reference = models(tiny_flux)
    target_c, target_r = inputs_c.pop("target"), inputs_r.pop("target")
    with torch.no_grad():
        ref_c = per_sample_error(reference(**inputs_c, return_dict=False)[0], target_c)
        ref_r = per_sample_error(reference(**inputs_r, return_dict=False)[0], target_r)
    out = diffusion_dpo_loss(
        per_sample_error(policy(**inputs_c, return_dict=False)[0], target_c),
        per_sample_error(policy(**inputs_r, return_dict=False)[0], target_r),
        ref_c,
        ref_r,
        BETA,
    )

    # direct: each member's batch built from the same noise and sigma, one forward per model and member (the
    # per-member batches of a training micro-batch: beta x a float difference of the errors is what the loss sees)
    def errors(model, x0):
        kwargs = {
            "hidden_states": (1 - s) * pack(x0) + s * noise,
            "timestep": sigmas,
            "encoder_hidden_states": cond["prompt_embeds"],
            "pooled_projections": cond["pooled_prompt_embeds"],
            "guidance": torch.full((2,), 3.5),
            "img_ids": inputs_c["img_ids"],
            "txt_ids": inputs_c["txt_ids"],
            "return_dict": False,
        }
        with torch.no_grad():
            return ((model(**kwargs)[0].float() - (noise - pack(x0))) ** 2).reshape(2, -1).mean(dim=1)

    theta_w, theta_l = errors(policy, cond["latents"]), errors(policy, cond["latents"].flip(0))
    ref_w, ref_l = errors(reference, cond["latents"]), errors(reference, cond["latents"].flip(0))
    inside = -0.5 * BETA * ((theta_w - ref_w) - (theta_l - ref_l))
    torch.testing.assert_close(out.loss.detach(), -F.logsigmoid(inside), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.margin, inside, rtol=1e-5, atol=1e-6)
    assert out.accurate.tolist() == (inside > 0).float().tolist()
    assert not torch.allclose(out.loss, torch.full((2,), 0.6931471805599453))  # the policy differs from the reference

    # the gradient reaches the policy only
    out.loss.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    assert all(p.grad is None for p in reference.parameters())


def test_policy_equal_to_reference_gives_log_two_and_bad_shapes_are_named():
    errors = torch.tensor([0.3, 0.5])
    out = diffusion_dpo_loss(errors, errors.flip(0), errors, errors.flip(0), BETA)
    torch.testing.assert_close(out.loss, torch.full((2,), float(torch.log(torch.tensor(2.0)))))
    assert out.accurate.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="vectors of one length"):
        diffusion_dpo_loss(errors, errors[:1], errors, errors, BETA)
