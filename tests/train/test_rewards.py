"""Rewards (spindle/train/rewards/): functions in real files and modules in both calling conventions, the
config forms, the errors before training and while scoring, a real HTTP scorer on loopback, the built-ins
(JPEG sizes, CLIP score on a tiny CLIP folder) and a reward-model folder, against direct computations."""

from __future__ import annotations

import base64
import io
import json
import socket
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from spindle.config import ConfigError, RewardList, RewardSpec, require_rewards, weighted_rewards
from spindle.train.rewards import RewardError, load_rewards
from spindle.train.rewards.images import reward_images

REWARDS_PY = """
import numpy as np

def brightness(images, prompts, **columns):
    return [float(np.mean(image)) for image in images]

def closeness(images, prompts, target):
    return [-abs(float(np.mean(image)) - t) for image, t in zip(images, target)]

def broken(images, prompts):
    raise ValueError("no scorer today")

def too_few(images, prompts):
    return [1.0]

def nan_on_second(images, prompts):
    return [0.0, float("nan"), 0.0][: len(images)]

def text_on_third(images, prompts):
    return [0.0, 1.0, "2.0"]

def length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

def says_yes(prompts, completions, answer):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def images(count: int = 3, size: tuple[int, int] = (8, 12)) -> list[np.ndarray]:
    g = np.random.default_rng(0)
    return [g.random((*size, 3), dtype=np.float32) * (i + 1) / count for i in range(count)]


def configs(*entries, weights=None, where="flow_grpo"):
    from pydantic import TypeAdapter

    return weighted_rewards(TypeAdapter(RewardList).validate_python(list(entries)), weights, where)


def test_file_functions_score_weight_and_get_their_columns(reward_file):
    rewards = load_rewards(
        configs({"fn": f"{reward_file}:brightness", "weight": 2.0}, {"fn": f"{reward_file}:closeness", "weight": 0.5}),
        "dit",
        "flow_grpo",
    )
    batch = images()
    scores = rewards(batch, ["a", "b", "c"], {"target": [0.5, 0.5, 0.5], "other": [1, 2, 3]})
    bright = torch.tensor([float(np.mean(i)) for i in batch])
    torch.testing.assert_close(scores.per_reward["brightness"], bright)
    torch.testing.assert_close(scores.per_reward["closeness"], -(bright - 0.5).abs())
    torch.testing.assert_close(scores.total, 2.0 * bright - 0.5 * (bright - 0.5).abs())
    assert rewards([], [], {"target": []}).total.shape == (0,)  # a rank with no samples this step
    assert scores.means() == pytest.approx(
        {"reward/brightness": float(bright.mean()), "reward/closeness": float(-(bright - 0.5).abs().mean())}
    )


def test_module_function_and_the_language_model_convention(reward_file, monkeypatch):
    monkeypatch.syspath_prepend(str(reward_file.parent))
    rewards = load_rewards(configs("my_rewards:length", "my_rewards:says_yes", weights=[1.0, 10.0]), "lm", "grpo")
    scores = rewards(["yes", " no"], ["Q1", "Q2"], {"answer": ["yes", "yes"]})
    assert scores.per_reward["length"].tolist() == [3.0, 3.0]
    assert scores.per_reward["says_yes"].tolist() == [1.0, 0.0]
    assert scores.total.tolist() == [13.0, 3.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("missing_dir/nope.py:fn", r"file missing_dir/nope.py not found"),
        ("spindle_no_such_module_x:fn", r"no module 'spindle_no_such_module_x' on the Python path"),
        ("{file}:brightnes", r"defines no function 'brightnes'; did you mean 'brightness'\?"),
        ("{file}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' in .* is a int, not a function"),
        ("{bad}:fn", r"importing .*bad_rewards.py failed: ZeroDivisionError"),
    ],
)
def test_a_reward_that_cannot_load_is_named_before_training(reward_file, spec, message):
    bad = reward_file.parent / "bad_rewards.py"
    bad.write_text("x = 1 / 0\n")
    spec = spec.format(file=reward_file, bad=bad)
    with pytest.raises(ConfigError, match=message) as e:
        load_rewards(configs(spec), "dit", "flow_grpo")
    assert repr(spec) in str(e.value)


def test_a_folder_is_refused_for_a_dit_model_and_a_builtin_for_a_language_model():
    with pytest.raises(ConfigError, match=r"flow_grpo.rewards\[0\] \(model: rewards_folder\) is a reward-model folder"):
        load_rewards(configs("rewards_folder"), "dit", "flow_grpo")
    with pytest.raises(ConfigError, match=r"grpo.rewards\[1\] \(builtin: jpeg_compressibility\) scores images"):
        load_rewards(configs("rewards_folder", "builtin:jpeg_compressibility", where="grpo"), "lm", "grpo")


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            "broken",
            r"reward 'broken' \(fn: .*:broken\) raised ValueError: no scorer today \(scoring prompt 'a red cat' and 2 more\)",
        ),
        ("too_few", r"reward 'too_few' .* returned 1 values for 3 samples \(prompt 'a red cat' and 2 more\)"),
        ("nan_on_second", r"reward 'nan_on_second' .* returned nan for prompt 'a blue dog' \(sample 1\)"),
        ("text_on_third", r"reward 'text_on_third' .* returned '2.0' for prompt 'a tree' \(sample 2\); every reward"),
    ],
)
def test_a_reward_failing_while_scoring_names_the_function_and_the_prompt(reward_file, fn, message):
    rewards = load_rewards(configs(f"{reward_file}:{fn}"), "dit", "flow_grpo")
    with pytest.raises(RewardError, match=message):
        rewards(images(), ["a red cat", "a blue dog", "a tree"])


def test_config_forms_and_their_errors():
    parsed = configs(
        "https://scorer:8000/score", "builtin:jpeg_incompressibility", "rm_folder", "a.py:f", {"fn": "m:f", "weight": 3}
    )
    assert [(r.url, r.builtin, r.model, r.fn) for r in parsed] == [
        ("https://scorer:8000/score", None, None, None),
        (None, "jpeg_incompressibility", None, None),
        (None, None, "rm_folder", None),
        (None, None, None, "a.py:f"),
        (None, None, None, "m:f"),
    ]
    assert parsed[4].weight == 3
    assert [r.weight for r in configs("a.py:f", "b.py:g", weights=[0.5, 2.0])] == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"flow_grpo.reward_weights has 1 entries for 2 rewards"):
        configs("a.py:f", "b.py:g", weights=[1.0])
    with pytest.raises(ValueError, match=r"flow_grpo.rewards\[0\] sets its own weight and flow_grpo.reward_weights"):
        configs({"fn": "a.py:f", "weight": 2.0}, weights=[1.0])
    with pytest.raises(ValueError, match=r"train.objective=flow_grpo needs rewards: flow_grpo\.rewards is empty"):
        require_rewards("flow_grpo", configs(), "rewards.py:brightness")
    with pytest.raises(ValidationError, match="exactly one of fn, model, url, builtin; got fn, url"):
        RewardSpec(fn="a.py:f", url="http://x")
    with pytest.raises(ValidationError, match="builtin clip_score needs clip_model"):
        RewardSpec(builtin="clip_score")
    with pytest.raises(ValidationError, match="timeout_s configure an HTTP scorer"):
        RewardSpec(fn="a.py:f", timeout_s=3)
    with pytest.raises(ValidationError, match="builtin"):
        RewardSpec(builtin="jpeg")


def test_reward_images_are_the_engines_decoded_samples_one_array_each():
    decoded = np.random.default_rng(0).random((2, 4, 5, 3), dtype=np.float32)
    out = reward_images(decoded)
    assert len(out) == 2 and out[0].shape == (4, 5, 3) and out[0].dtype == np.float32
    np.testing.assert_array_equal(out[1], decoded[1])
    video = reward_images(np.full((1, 2, 4, 5, 3), 1.5))
    assert video[0].shape == (2, 4, 5, 3) and video[0].max() == 1.0
    with pytest.raises(ValueError, match=r"\[B, H, W, 3\] or \[B, F, H, W, 3\]; got \(2, 3, 4, 5\)"):
        reward_images(np.zeros((2, 3, 4, 5)))


# --- built-ins ----------------------------------------------------------------------------------------------


def jpeg_kb(image: np.ndarray) -> float:
    buffer = io.BytesIO()
    Image.fromarray((image * 255).round().clip(0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000


def test_jpeg_rewards_are_ddpos():
    rewards = load_rewards(configs("builtin:jpeg_compressibility", "builtin:jpeg_incompressibility"), "dit", "x")
    flat = np.full((32, 32, 3), 0.5, dtype=np.float32)
    noisy = np.random.default_rng(1).random((32, 32, 3), dtype=np.float32)
    video = np.stack([flat, noisy])
    scores = rewards([flat, noisy, video], ["p", "q", "r"])
    sizes = torch.tensor([jpeg_kb(flat), jpeg_kb(noisy), (jpeg_kb(flat) + jpeg_kb(noisy)) / 2])
    torch.testing.assert_close(scores.per_reward["jpeg_incompressibility"], sizes)
    torch.testing.assert_close(scores.per_reward["jpeg_compressibility"], -sizes)
    assert scores.per_reward["jpeg_compressibility"][0] > scores.per_reward["jpeg_compressibility"][1]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    """A tiny random CLIP folder as transformers saves one: model, the locally built CLIP-style tokenizer, and a
    CLIP image processor (32 px)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from spindle.models.shared.tokenizers import save_tokenizer

    out = tmp_path_factory.mktemp("tiny-clip")
    vocab = save_tokenizer(out, model_max_length=16, bos_token="<s>")
    text = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=3,
    )
    vision = dict(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(out)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)
    return out


def test_clip_score_is_clips_prompt_image_cosine(tiny_clip):
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    rewards = load_rewards(
        configs({"builtin": "clip_score", "clip_model": str(tiny_clip), "batch_size": 2}), "dit", "x"
    )
    batch = images(3, size=(32, 32))
    prompts = ["a red circle", "a blue square on the left", "a dog"]
    scores = rewards(batch, prompts).per_reward["clip_score"]

    model = CLIPModel.from_pretrained(tiny_clip).eval()
    processor = AutoImageProcessor.from_pretrained(tiny_clip)
    tokenizer = AutoTokenizer.from_pretrained(tiny_clip)
    with torch.no_grad():
        for i, (image, prompt) in enumerate(zip(batch, prompts, strict=True)):
            pil = Image.fromarray((image * 255).round().astype(np.uint8))
            out = model(**tokenizer([prompt], return_tensors="pt"), **processor(images=[pil], return_tensors="pt"))
            expected = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds)[0]
            torch.testing.assert_close(scores[i], expected, rtol=0, atol=1e-5)
    assert len(set(scores.tolist())) == 3


def test_clip_score_without_a_clip_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"clip_model .*nowhere is not a transformers CLIP folder"):
        load_rewards(configs({"builtin": "clip_score", "clip_model": str(tmp_path / "nowhere")}), "dit", "x")


# --- reward-model folder (language models) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_reward_model(tiny_qwen3, tmp_path_factory) -> Path:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-rm")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_qwen3, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_qwen3).save_pretrained(out)
    return out


def test_reward_model_folder_scores_prompt_plus_completion(tiny_reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rewards = load_rewards(configs(str(tiny_reward_model)), "lm", "grpo")
    prompts = ["what colour is the sky?", "say yes"]
    completions = [" blue", " no no no"]
    scores = rewards(completions, prompts).per_reward[tiny_reward_model.name]
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)
    with torch.no_grad():
        for i in range(2):  # one at a time: no padding at all
            ids = tokenizer(prompts[i] + completions[i], add_special_tokens=False, return_tensors="pt")
            torch.testing.assert_close(scores[i], model(**ids).logits[0, 0], rtol=0, atol=1e-5)
    chat = rewards([[{"role": "assistant", "content": "blue"}]], [[{"role": "user", "content": "what colour?"}]])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what colour?"}, {"role": "assistant", "content": "blue"}], tokenize=False
    )
    with torch.no_grad():
        expected = model(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0]
    torch.testing.assert_close(chat.total[0], expected, rtol=0, atol=1e-5)


def test_reward_model_with_several_labels_is_refused(tiny_qwen3, tmp_path):
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(tiny_qwen3, num_labels=3).save_pretrained(tmp_path / "rm3")
    with pytest.raises(ConfigError, match="has 3 labels; a reward model has one"):
        load_rewards(configs(str(tmp_path / "rm3")), "lm", "grpo")


# --- HTTP scorer ----------------------------------------------------------------------------------------------


class Scorer:
    """A real HTTP scorer on loopback: mean brightness of the posted PNGs. `fail_first` answers 503 that many
    times; `pairs` makes every request wait (bounded) at a two-party barrier, so requests only succeed when two
    are in flight at once; `hold` keeps every request waiting until it is set (timeouts)."""

    def __init__(self, fail_first: int = 0, pairs: bool = False, status: int | None = None) -> None:
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_first = fail_first
        self.barrier = threading.Barrier(2) if pairs else None
        self.status = status
        self.hold = threading.Event()
        self.hold.set()
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with scorer.lock:
                    scorer.requests += 1
                    scorer.in_flight += 1
                    scorer.max_in_flight = max(scorer.max_in_flight, scorer.in_flight)
                    failing = scorer.requests <= scorer.fail_first
                    scorer.bodies.append(body)
                try:
                    scorer.hold.wait(10)
                    if scorer.barrier is not None:
                        scorer.barrier.wait(timeout=10)
                    if scorer.status is not None or failing:
                        self.reply(scorer.status or 503, {"error": "scorer says no"})
                        return
                    self.reply(200, {"scores": [brightness_of(image) for image in body["images"]]})
                finally:
                    with scorer.lock:
                        scorer.in_flight -= 1

            def reply(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Scorer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def decode_png(data: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data)))).astype(np.float32) / 255


def brightness_of(image: str | list[str]) -> float:
    frames = [image] if isinstance(image, str) else image
    return float(np.mean([decode_png(f).mean() for f in frames]))


def http(url: str, **options):
    return configs({"url": url, "backoff_s": 0.01, **options})


def test_http_scorer_scores_pngs_in_bounded_concurrent_batches():
    batch = images(6)
    with Scorer(pairs=True) as scorer:
        rewards = load_rewards(http(scorer.url, batch_size=1, concurrency=2, timeout_s=20), "dit", "flow_grpo")
        scores = rewards(batch, [f"p{i}" for i in range(6)], {"seed": list(range(6))}).total
    expected = [float(np.round(i * 255).astype(np.uint8).astype(np.float32).mean() / 255) for i in batch]
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-6)
    # six one-sample requests, two at a time (the barrier lets a request through only beside another)
    assert scorer.requests == 6 and scorer.max_in_flight == 2
    assert sorted(b["prompts"][0] for b in scorer.bodies) == [f"p{i}" for i in range(6)]
    assert sorted(b["columns"]["seed"][0] for b in scorer.bodies) == list(range(6))


def test_http_scorer_sends_videos_as_frame_lists_and_retries_a_failing_scorer():
    video = np.stack(images(2, size=(8, 8)))
    with Scorer(fail_first=2) as scorer:
        rewards = load_rewards(http(scorer.url, retries=2), "dit", "flow_grpo")
        score = rewards([video], ["a video"]).total
    assert scorer.requests == 3
    assert len(scorer.bodies[-1]["images"][0]) == 2  # the frames
    expected = np.mean([np.round(f * 255).astype(np.uint8).mean() / 255 for f in video])
    assert float(score[0]) == pytest.approx(expected, rel=1e-6)


def test_http_scorer_that_is_down_or_slow_or_refuses_is_named():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    rewards = load_rewards(http(url, retries=1), "dit", "flow_grpo")
    with pytest.raises(RewardError, match=rf"reward scorer at {url} failed 2 tries .*check that it is running"):
        rewards(images(1), ["p"])

    with Scorer(fail_first=10) as scorer:
        rewards = load_rewards(http(scorer.url, retries=1), "dit", "flow_grpo")
        with pytest.raises(RewardError, match=r"failed 2 tries \(HTTP 503 .*scorer says no"):
            rewards(images(1), ["p"])
        assert scorer.requests == 2

    with Scorer() as scorer:
        scorer.hold.clear()  # answers nothing until released
        rewards = load_rewards(http(scorer.url, retries=0, timeout_s=0.3), "dit", "flow_grpo")
        with pytest.raises(
            RewardError, match=rf"reward scorer at {scorer.url} failed 1 tries \(timed out after 0.3s\)"
        ):
            rewards(images(1), ["p"])

    with Scorer(status=422) as scorer:
        rewards = load_rewards(http(scorer.url, retries=3), "dit", "flow_grpo")
        with pytest.raises(RewardError, match=r"refused the request: HTTP 422 .*scorer says no"):
            rewards(images(1), ["p"])
        assert scorer.requests == 1  # a 4xx is not retried


def test_the_docs_worked_example_reward_loads_and_prefers_brighter_images(tmp_path, monkeypatch):
    """docs/post-training-dit.md's mean-brightness reward, as a user copies it into rewards.py and names it."""
    page = (Path(__file__).parents[2] / "docs" / "post-training-dit.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "rewards.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards(configs("rewards.py:brightness"), "dit", "flow_grpo")
    dark, bright = np.full((4, 4, 3), 0.2, dtype=np.float32), np.full((4, 4, 3), 0.9, dtype=np.float32)
    assert rewards([dark, bright], ["a", "a"]).per_reward["brightness"].tolist() == pytest.approx([0.2, 0.9])


def test_functions_are_called_by_keyword_with_what_they_take(tmp_path):
    (tmp_path / "kw.py").write_text(
        textwrap.dedent(
            """
            def trl_style(completions, **kwargs):
                return [float("prompts" in kwargs) + len(c) for c in completions]

            def images_only(images):
                return [1.0 for _ in images]

            def wrong_names(imgs, ps):
                return [0.0 for _ in imgs]
            """
        )
    )
    lm = load_rewards(configs(f"{tmp_path}/kw.py:trl_style"), "lm", "grpo")
    assert lm(["ab", "c"], ["p", "q"], {"extra": [1, 2]}).total.tolist() == [3.0, 2.0]
    dit = load_rewards(configs(f"{tmp_path}/kw.py:images_only"), "dit", "flow_grpo")
    assert dit(images(2), ["p", "q"], {"colour": ["red", "blue"]}).total.tolist() == [1.0, 1.0]
    with pytest.raises(ConfigError, match=r"takes \(imgs, ps\), but rewards are called as fn\(images=.*'images'"):
        load_rewards(configs(f"{tmp_path}/kw.py:wrong_names"), "dit", "flow_grpo")
    with pytest.raises(ConfigError, match=r"takes \(imgs, ps\), .*TRL's.*'completions'"):
        load_rewards(configs(f"{tmp_path}/kw.py:wrong_names"), "lm", "grpo")
    with pytest.raises(RewardError, match="a column may not be named 'prompts'"):
        dit(images(1), ["p"], {"prompts": ["x"]})
