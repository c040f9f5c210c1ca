"""DiT attention through diffusers' dispatcher backends (`--attention-backend`, `model.attention_backend`,
spindle.ops.dit_attention): another backend gives the default's output, and one that cannot run here is refused
before any model loads, naming why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator, make_trainer
from spindle.config import ConfigError
from spindle.engine_config import EngineConfig
from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides, load_job_config, train_overrides

SMALL = dict(prompt="a lighthouse", height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.0)


def test_generate_with_another_backend_equals_the_default(tiny_wan):
    default = load_generator(tiny_wan).generate(**SMALL, seed=0)
    generator = load_generator(tiny_wan, attention_backend="_native_math")
    backends = {
        getattr(m, "processor", None) and m.processor._attention_backend for m in generator.transformer.modules()
    }
    assert "_native_math" in {getattr(b, "value", b) for b in backends}  # set on the attention processors
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    assert _AttentionBackendRegistry.get_active_backend()[0].value == "native"  # other models keep theirs
    math = generator.generate(**SMALL, seed=0)
    np.testing.assert_allclose(np.asarray(math.frames), np.asarray(default.frames), atol=1e-5)


@pytest.mark.parametrize(
    "backend, reason",
    [("flash", "CUDA kernels"), ("flash_hub", "downloads its kernel"), ("flashh", "not one of diffusers'")],
)
def test_a_backend_that_cannot_run_is_refused_before_loading(backend, reason):
    with pytest.raises(ValueError, match=reason):
        EngineConfig(device="cpu", attention_backend=backend)


def test_training_with_another_backend_equals_the_default(tiny_wan, shapes_videos, tmp_path):
    losses = {}
    for backend in ("native", "_native_math"):
        out = tmp_path / backend
        cfg = load_job_config(
            None,
            train_overrides(
                tiny_wan,
                shapes_videos,
                out,
                train__max_steps=2,
                checkpoint__export=False,
                model__attention_backend=backend,
            ),
        )
        make_trainer(cfg).run()
        losses[backend] = [m["loss"] for m in read_metrics(out)]
    assert losses["_native_math"] == pytest.approx(losses["native"], rel=1e-5)


def test_training_refuses_a_backend_before_the_model_loads(tiny_wan, shapes_videos, tiny_qwen3, lm_corpus, tmp_path):
    cfg = load_job_config(
        None, train_overrides(tiny_wan, shapes_videos, tmp_path / "r", model__attention_backend="sage")
    )
    with pytest.raises(ConfigError, match=r"model\.attention_backend"):
        make_trainer(cfg)
    with pytest.raises(ConfigError, match="DiT setting"):
        load_job_config(None, lm_overrides(tiny_qwen3, lm_corpus, tmp_path / "l", model__attention_backend="flash"))
    assert torch.get_default_dtype() == torch.float32
