"""Image/video conversation JSONL -> token rows with vision inputs for VLM training.

Each line of a `.jsonl` file (or of every `.jsonl` under a folder, in sorted path order) is one
conversation, in one of two formats:

- OpenAI/Qwen messages: `{"messages": [{"role": ..., "content": ...}]}`, the content a string or a
  list of parts `{"type": "image", "image": PATH}`, `{"type": "video", "video": PATH}`,
  `{"type": "audio", "audio": PATH}` (omni models: spindle.data.audio), `{"type": "text", "text": ...}`,
  and OpenAI's `{"type": "image_url", "image_url": {"url": URL}}` (a base64 data URL, a `file://` URL or a
  path; http(s) URLs are refused, never fetched);
- LLaVA/ShareGPT: `{"images": [PATH, ...], "conversations": [{"from": "human"|"gpt"|"system",
  "value": "<image>\\n..."}]}` (or `"messages"` with string contents), one `<image>` (`<video>` with
  `"videos"`, `<audio>` with `"audios"`) placeholder per file, in order.

Paths are relative to the JSONL file. Images go through the model's image processor (its
`preprocessor_config.json`, `min_pixels`/`max_pixels` settable); videos are decoded with PyAV, frames
sampled by `fps`/`max_frames`, and patched as the stock Qwen-VL video processor does (Qwen3-VL: its own
sampling, clip resize and per-patch timestamps in the text, spindle.data.video_timestamps). The chat template
renders the conversation with one `<|image_pad|>` (`<|video_pad|>`) per image (video), which is then
expanded to the image's `grid_thw.prod() // merge_size**2` tokens, as the stock processor does. Only
assistant turns are learned (`spindle.data.text.learn_assistant_turns`).

Rows hold `input_ids`, `position_ids` [4, seq_len] (row 0: text positions, restarting per document,
from which attention reads the documents, spindle/ops/varlen_attention.py; rows 1-3: the model's 3-D RoPE positions
of each document, computed by the family's `rope_index`), `shift_labels`, `attention_mask`, and the
rows' vision inputs (`pixel_values` + `image_grid_thw`, `pixel_values_videos` + `video_grid_thw` +
`second_per_grid_ts`; audio: `input_features` + `feature_attention_mask`) in token order. Packing
follows `spindle.data.text`: documents end to end, a document that does not fit starts the next row;
`packing: false` gives one document per row. A micro-batch is cut to its longest row (a multiple of the SP
degree; `collate_conversations`). A conversation longer than `seq_len` is cut at `seq_len`
only when no image/video/audio token is cut; otherwise it is a `file:line` error (or a counted skip
with `skip_bad_samples`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from spindle.data.text import (
    IGNORE_INDEX,
    TextDataError,
    json_line,
    jsonl_files,
    learn_assistant_turns,
    shifted_labels,
    trim_padding,
)

if TYPE_CHECKING:
    from spindle.data.stock_video import VideoClips

log = logging.getLogger("spindle.data")

MEDIA_KINDS = ("image", "video", "audio")  # content-part types besides text
# the LLaVA/ShareGPT placeholders of each kind (its files listed under "images" / "videos" / "audios")
PLACEHOLDERS = {f"<{kind}>": kind for kind in MEDIA_KINDS}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Audio:
    """One audio clip after feature extraction: what the audio encoder takes (spindle.data.audio)."""

    features: torch.Tensor  # [mel bins, frames]: the valid log-mel frames
    kind: str = "audio"


@dataclass
class Vision:
    """One image or video after patching: what the vision tower takes."""

    kind: str  # "image" | "video"
    # [patches, channels * temporal_patch * patch * patch]; a fixed-size tower's image: [1, channels, height, width]
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor | None  # [3]; None: a fixed-size tower's image (no patch grid, `FixedSizeImages`)
    second_per_grid: float = 1.0  # videos: seconds per temporal grid step (mrope temporal spacing)
    # Qwen3-VL videos: each temporal patch's time, written into the text before the patch's tokens (then
    # the model's positions need no second_per_grid)
    timestamps: list[float] | None = None
    audio: Audio | None = None  # a video's own audio track (data.use_audio_in_video), interleaved with its frames


Media = Vision | Audio


@dataclass
class MMDocument:
    tokens: list[int]
    learn: list[bool]
    positions: torch.Tensor  # [3, len(tokens)] multimodal RoPE positions
    vision: list[Media]  # images, videos and audio clips in token order
    source: str  # "file:line"


@dataclass
class MMStats:
    documents: int
    rows: int
    truncated: int  # conversations cut at seq_len (text only was cut)
    skipped: int  # bad lines skipped (data.skip_bad_samples)
    label_tokens: int
    images: int
    videos: int
    audios: int = 0


@dataclass
class VisionOptions:
    """How images and videos become patches (data.min_pixels, max_pixels, fps, max_frames)."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float = 2.0
    max_frames: int = 16
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- the processor side


class GridImages:
    """Qwen-VL's images (the default `VisionProcessor.images`): the image processor patches each image at its own
    size into a `grid_thw` of patches, merged `merge_size` x `merge_size` into the decoder's tokens; the chat
    template's `<|image_pad|>` (the config's `image_token_id`) repeats once per token.

    A family's own layout (`VLMFamily.images`) has the same members: `processor` (the image processor),
    `pad_token` (the template's token of an image), `token_ids` (the ids of an image's tokens in the expanded
    text), `encode(rgb) -> Vision`, `tokens(image) -> int`, `text(image, tokens) -> str`, `merge_size`."""

    def __init__(self, model_path: str | Path, tokenizer: Any, config: Any, options: VisionOptions):
        from transformers import AutoImageProcessor

        # The processor's own min_pixels/max_pixels keywords (they override its config's `size`).
        kwargs = {k: v for k, v in (("min_pixels", options.min_pixels), ("max_pixels", options.max_pixels)) if v}
        self.processor = AutoImageProcessor.from_pretrained(model_path, **kwargs)
        self.merge_size = int(self.processor.merge_size)
        self.pad_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.token_ids = {int(config.image_token_id)}

    def encode(self, rgb: Any) -> Vision:
        out = self.processor(images=[rgb], return_tensors="pt")
        return Vision("image", out["pixel_values"], out["image_grid_thw"][0])

    def tokens(self, image: Vision) -> int:
        assert image.grid_thw is not None, "a patched image has its grid"
        return int(image.grid_thw.prod()) // self.merge_size**2

    def text(self, image: Vision, tokens: int) -> str:
        return str(self.pad_token * tokens)


class VisionProcessor:
    """The model's tokenizer, image processor and token ids: conversation -> tokens + vision inputs."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: Any,
        config: Any,
        rope_index: Any,
        options: VisionOptions,
        video_timestamps: bool = False,
        video_grid_seconds: str = "sampled_fps",
        audio: bool = False,
        video_audio_layout: Any = None,
        audio_tokens: Any = None,
        images: Any = None,
    ):
        # the family's image layout (`VLMFamily.images`: a class taking (model_path, tokenizer, config, options));
        # None: Qwen-VL's patch grid
        self.images = (images or GridImages)(model_path, tokenizer, config, options)
        self.image_processor = self.images.processor
        self.tokenizer, self.config, self.rope_index, self.options = tokenizer, config, rope_index, options
        self.model_path = model_path
        self.merge_size = int(self.images.merge_size)
        self.pad_token = {"image": self.images.pad_token}
        # a model with no video token (Gemma 3) takes no video
        if getattr(config, "video_token_id", None) is not None:
            self.pad_token["video"] = tokenizer.convert_ids_to_tokens(config.video_token_id)
        self.video_timestamps, self.video_grid_seconds = video_timestamps, video_grid_seconds
        # use_audio_in_video: the family's placeholder text of a video and its audio track, interleaved
        self.video_audio_layout = video_audio_layout
        # the family's (config, mel frames) -> decoder tokens of a clip; None: Qwen2.5-Omni's encoder
        self.audio_tokens = audio_tokens
        self.feature_extractor = None  # audio models: the checkpoint's WhisperFeatureExtractor
        if audio:
            from transformers import AutoFeatureExtractor

            self.feature_extractor = AutoFeatureExtractor.from_pretrained(model_path)
            self.pad_token["audio"] = tokenizer.convert_ids_to_tokens(config.audio_token_id)
        # the tokens the media become in the expanded text (an image's are its layout's)
        self.media_ids = {tokenizer.convert_tokens_to_ids(t) for k, t in self.pad_token.items() if k != "image"}
        self.media_ids |= self.images.token_ids
        if not getattr(tokenizer, "chat_template", None):
            raise TextDataError(f"the tokenizer of {model_path} has no chat_template; VLM data needs one")

    def image(self, path: Path | str) -> Vision:
        """An image file, or a base64 data URL (an OpenAI `image_url` part) -> the processor's patches."""
        from spindle.data.media import MediaError, load_image

        if is_data_url(path):
            rgb = decode_data_url_image(str(path))
        else:
            if not Path(path).is_file():
                raise ValueError(f"image {path} not found")
            try:  # over the bomb limit or, with data.max_pixels, too big to decode in bounded memory: named
                rgb = load_image(path, self.options.max_pixels).convert("RGB")
            except MediaError as e:
                raise ValueError(f"image {path} cannot be decoded ({e.problem})") from None
        image: Vision = self.images.encode(rgb)
        return image

    @cached_property
    def videos(self) -> VideoClips:
        """The checkpoint's stock video processor and its reader (loaded at the first video): Qwen3-VL's with
        timestamps (`video_timestamps`), else Qwen2-VL's."""
        from spindle.data.stock_video import Qwen2VLVideos
        from spindle.data.video_timestamps import TimestampedVideos

        if self.video_timestamps:
            return TimestampedVideos(self.model_path, self.image_processor, self.tokenizer, self.config, self.options)
        return Qwen2VLVideos(self.model_path, self.image_processor, self.options)

    def video(self, path: Path) -> Vision:
        from spindle.data.stock_video import Qwen2VLVideos

        if "video" not in self.pad_token:
            raise ValueError(f"video {path.name}: {self.config.model_type} models take no video; give images")

        videos = self.videos
        clip = videos.read(path)
        if not isinstance(videos, Qwen2VLVideos):  # Qwen3-VL: timestamps in the text, no seconds per grid
            from spindle.data.video_timestamps import TimestampedVideos

            assert isinstance(videos, TimestampedVideos)
            return Vision("video", clip.pixel_values, clip.grid_thw, timestamps=videos.timestamps(clip))
        seconds = videos.second_per_grid(clip, self.video_grid_seconds)
        track = None
        if self.video_audio_layout is not None:
            try:
                track = self.audio(path)
            except ValueError as e:
                raise ValueError(f"{e}; data.use_audio_in_video needs every video to have an audio track") from None
        return Vision("video", clip.pixel_values, clip.grid_thw, second_per_grid=seconds, audio=track)

    def audio(self, path: Path) -> Audio:
        if self.feature_extractor is None:
            raise ValueError(
                f"audio {path.name}: {self.config.model_type} models take no audio; audio parts need an omni-modal "
                "model (e.g. qwen2_5_omni)"
            )
        from spindle.data.audio import audio_features, decode_audio

        samples = decode_audio(path, int(self.feature_extractor.sampling_rate))
        return Audio(audio_features(samples, self.feature_extractor, f"audio {path}"))

    def media(self, kind: str, path: Path | str) -> Media:
        if kind == "audio":
            return self.audio(Path(path))
        return self.image(path) if kind == "image" else self.video(Path(path))

    def tokens(self, vision: list[Media]) -> list[int]:
        """How many placeholder tokens each input expands to."""
        from spindle.data.audio import audio_token_count

        def count(v: Media) -> int:
            if isinstance(v, Audio):
                frames = v.features.shape[1]
                return (
                    audio_token_count(frames)
                    if self.audio_tokens is None
                    else int(self.audio_tokens(self.config, frames))
                )
            if v.kind == "image":
                return int(self.images.tokens(v))
            assert v.grid_thw is not None, "a video has its patch grid"
            return int(v.grid_thw.prod()) // self.merge_size**2 + (count(v.audio) if v.audio is not None else 0)

        return [count(v) for v in vision]

    def clips(self, vision: list[Media]) -> list[Audio]:
        """The audio clips in token order (a video's own track where it stands)."""
        return [a for v in vision for a in ([v] if isinstance(v, Audio) else [v.audio] if v.audio else [])]

    def placeholder(self, v: Media, tokens: int) -> str:
        """What the template's pad token of `v` becomes: `tokens` pad tokens, or a video's frames and audio
        interleaved (the family's `video_audio_layout`)."""
        if isinstance(v, Vision) and v.audio is not None:
            text: str = self.video_audio_layout(
                self.config, self.tokenizer, v.grid_thw, v.second_per_grid, self.tokens([v.audio])[0], self.merge_size
            )
            return text
        if isinstance(v, Vision) and v.timestamps is not None:
            from spindle.data.video_timestamps import TimestampedVideos

            assert isinstance(self.videos, TimestampedVideos)
            return self.videos.text(v.timestamps, self.pad_token["video"] * (tokens // len(v.timestamps)))
        if isinstance(v, Vision) and v.kind == "image":
            return str(self.images.text(v, tokens))
        return self.pad_token[v.kind] * tokens

    def load_media(self, messages: list[dict], base: Path) -> list[Media]:
        """Every image / video / audio part of `messages`, in order (paths relative to `base`; data URLs as given)."""
        return [self.media(kind, path if is_data_url(path) else base / path) for kind, path in media_parts(messages)]

    def check_placeholders(self, tokens: list[int], media: list[Media]) -> None:
        """`tokens` hold one expanded pad-token run per input of `media` (ValueError otherwise)."""
        if sum(t in self.media_ids for t in tokens) != sum(self.tokens(media)):
            raise ValueError("the chat template did not place one pad token per image/video/audio part")

    def render(self, messages: list[dict], vision: list[Media], generation_prompt: bool) -> list[int]:
        """The template's text with every pad token expanded to its input's token count, tokenized."""
        if not messages and not generation_prompt:
            return []
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        # Each pad token takes the next vision input of its kind, in order (as the stock processor does).
        counts: dict[str, list[str]] = {kind: [] for kind in self.pad_token}
        for v, n in zip(vision, self.tokens(vision), strict=True):
            counts[v.kind].append(self.placeholder(v, n))
        pieces: list[str] = []
        rest = text
        while found := [(rest.find(token), k) for k, token in self.pad_token.items() if token in rest]:
            at, kind = min(found)
            if not counts[kind]:
                raise ValueError(f"the conversation has more {kind} placeholders than {kind}s")
            pieces += [rest[:at], counts[kind].pop(0)]
            rest = rest[at + len(self.pad_token[kind]) :]
        pieces.append(rest)
        return list(self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"])

    def positions(self, tokens: list[int], vision: list[Media]) -> torch.Tensor:
        """The document's [R, L] multimodal RoPE positions (the family's `rope_index`: the model's code): R = 3
        for the Qwen-VL families' 3-D RoPE, R = 0 for a model with 1-D positions (Gemma 3: the text positions)."""

        def grids(kind: str) -> torch.Tensor | None:
            g = [v.grid_thw for v in vision if isinstance(v, Vision) and v.kind == kind and v.grid_thw is not None]
            return torch.stack(g) if g else None

        videos = [v for v in vision if isinstance(v, Vision) and v.kind == "video"]
        seconds = torch.tensor([v.second_per_grid for v in videos]) if videos else None
        ids = torch.tensor([tokens], dtype=torch.long)
        extra: dict[str, Any] = {}
        if self.feature_extractor is not None:  # audio models: each clip's mel frame count
            extra["audio_seqlens"] = torch.tensor([a.features.shape[1] for a in self.clips(vision)])
        if self.video_audio_layout is not None:
            extra["use_audio_in_video"] = True
        pos: torch.Tensor = self.rope_index(self.config, ids, grids("image"), grids("video"), seconds, **extra)
        return pos[:, 0]


# ---------------------------------------------------------------- parsing


def is_data_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("data:")


def decode_data_url(url: str) -> bytes:
    """A base64 `data:` URL -> its bytes; a ValueError naming what is wrong otherwise."""
    import base64
    import binascii

    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise ValueError(f"image_url data URL must be 'data:image/...;base64,...'; got {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url data URL: its base64 does not decode") from None


def decode_data_url_image(url: str) -> Any:
    """A base64 image data URL -> an RGB PIL image (Pillow's decompression-bomb limit applies); a ValueError
    naming the data URL otherwise."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(decode_data_url(url))) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"image data URL {url[:40]}... cannot be decoded ({e})") from None


def _image_url(part: dict, where: str) -> str:
    """An OpenAI content part `{"type": "image_url", "image_url": {"url": ...}}` (or the url as a string) -> the
    image it names: a base64 data URL as given, a local file (`file://` or a path, relative to the JSONL
    file); an http(s) URL is refused, never fetched."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f'{where} of type image_url needs "image_url": {{"url": DATA_URL_OR_PATH}}, got {part!r}')
    if url.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: image URLs are not fetched ({url[:60]}); download the image and give its path or a data URL"
        )
    return url.removeprefix("file://")


def _check_path(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a file path string, got {value!r}")
    return value


def _parts_from_string(text: str, listed: dict[str, list[str]]) -> list[dict]:
    """A LLaVA/ShareGPT string with <image>/<video>/<audio> placeholders -> content parts, taking each kind's
    `listed` files in order."""
    parts: list[dict] = []
    rest = text
    while True:
        found = [(rest.find(p), p) for p in PLACEHOLDERS if p in rest]
        if not found:
            break
        at, placeholder = min(found)
        if rest[:at]:
            parts.append({"type": "text", "text": rest[:at]})
        kind = PLACEHOLDERS[placeholder]
        files = listed[kind]
        if not files:
            raise ValueError(f"more {placeholder} placeholders than {kind} files in the line's {kind}s list")
        parts.append({"type": kind, kind: files.pop(0)})
        rest = rest[at + len(placeholder) :]
    if rest:
        parts.append({"type": "text", "text": rest})
    return parts


def normalise_conversation(obj: Any) -> list[dict]:
    """Either accepted format -> messages with string or content-part contents (media paths as given)."""
    if not isinstance(obj, dict):
        raise ValueError('each line must be a JSON object with "messages" or "conversations"')
    listed = {kind: [_check_path(p, f"{kind}s[]") for p in obj.get(f"{kind}s", [])] for kind in MEDIA_KINDS}
    placed = any(listed.values())
    if "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError('"conversations" must be a non-empty list of {"from", "value"} objects')
        raw = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES or not isinstance(t.get("value"), str):
                raise ValueError(f'conversations[{i}] must be {{"from": human|gpt|system, "value": string}}, got {t!r}')
            raw.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    elif "messages" in obj:
        raw = obj["messages"]
        if not isinstance(raw, list) or not raw:
            raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    else:
        raise ValueError('each line must have "messages" (OpenAI/Qwen format) or "conversations" (ShareGPT)')
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f'messages[{i}] must be an object with a string "role", got {m!r}')
        content = m.get("content")
        if isinstance(content, str):
            if placed:  # LLaVA style: placeholders in strings
                content = _parts_from_string(content, listed)
        elif isinstance(content, list):
            content = list(content)
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url":  # OpenAI's chat format: the image part as {"type": "image", ...}
                    part = content[j] = {"type": "image", "image": _image_url(part, f"messages[{i}].content[{j}]")}
                    kind = "image"
                if kind not in ("text", *MEDIA_KINDS):
                    raise ValueError(
                        f'messages[{i}].content[{j}] must have "type" text, image, image_url, video or audio, '
                        f"got {part!r}"
                    )
                if kind == "text" and not isinstance(part.get("text"), str):
                    raise ValueError(f'messages[{i}].content[{j}] of type text needs a string "text"')
                if kind != "text":
                    _check_path(part.get(kind), f"messages[{i}].content[{j}].{kind}")
        else:
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
        messages.append({"role": m["role"], "content": content})
    if left := [f"{len(files)} {kind}(s)" for kind, files in listed.items() if files]:
        raise ValueError(f"{left[0]} listed but never placed: add one placeholder per file")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn: there is nothing to learn")
    return messages


def media_parts(messages: list[dict]) -> list[tuple[str, str]]:
    """(kind, path) of every image/video/audio part, in order."""
    return [
        (part["type"], part[part["type"]])
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] != "text"
    ]


def conversation_document(
    obj: Any, base: Path, processor: VisionProcessor, seq_len: int, where: str
) -> tuple[MMDocument, bool]:
    """One line -> (document, whether its text tail was cut to seq_len)."""
    messages = normalise_conversation(obj)
    vision = processor.load_media(messages, base)

    def render(prefix: list[dict], generation_prompt: bool) -> list[int]:
        # a prefix holds the first k media of the conversation
        return processor.render(prefix, vision[: len(media_parts(prefix))], generation_prompt)

    tokens, learn = learn_assistant_turns(messages, render)
    vision_ids = processor.media_ids
    processor.check_placeholders(tokens, vision)
    positions = processor.positions(tokens, vision)
    cut = len(tokens) > seq_len
    if cut:
        if any(t in vision_ids for t in tokens[seq_len:]):
            raise ValueError(
                f"the conversation is {len(tokens)} tokens, longer than data.seq_len={seq_len}, and cutting it would "
                "cut image/video/audio tokens; raise data.seq_len, lower data.max_pixels / data.max_frames or "
                "shorten the clips"
            )
        tokens, learn, positions = tokens[:seq_len], learn[:seq_len], positions[:, :seq_len]
    if not any(learn[1:]):
        raise ValueError("no assistant token is left to learn within data.seq_len")
    return MMDocument(tokens, learn, positions, vision, where), cut


def read_conversations(
    path: str | Path, processor: VisionProcessor, seq_len: int, skip_bad_samples: bool = False
) -> tuple[list[MMDocument], int, int]:
    """Every conversation of the JSONL file(s) at `path`; -> (documents, truncated, bad lines skipped)."""
    docs: list[MMDocument] = []
    truncated = skipped = 0
    for file in jsonl_files(path):
        with file.open("rb") as f:  # decoded line by line: one bad byte is one bad line, not a crash
            for number, raw in enumerate(f, start=1):
                where = f"{file}:{number}"
                try:
                    obj = json_line(raw)
                    doc, cut = conversation_document(obj, file.parent, processor, seq_len, where)
                except ValueError as e:
                    if not skip_bad_samples:
                        raise TextDataError(
                            f"{where}: {e} (fix the line, or set data.skip_bad_samples: true)"
                        ) from None
                    log.warning("skipping %s: %s", where, e)
                    skipped += 1
                    continue
                docs.append(doc)
                truncated += cut
    if not docs:
        raise TextDataError(f"data.path {path} has no usable conversations ({skipped} bad lines skipped)")
    return docs, truncated, skipped


# ---------------------------------------------------------------- rows

TOKEN_KEYS = ("input_ids", "position_ids", "shift_labels", "attention_mask")


def continued(rope: torch.Tensor, pad: int) -> torch.Tensor:
    """[R, L] multimodal RoPE positions -> [R, L + pad], the padding one past the largest position in every row
    (R = 0: a model with 1-D positions has none to continue)."""
    if rope.shape[0] == 0:
        return rope.new_zeros(0, rope.shape[1] + pad)
    return torch.cat([rope, rope.max() + 1 + torch.arange(pad).expand(rope.shape[0], pad)], dim=1)


def model_positions(positions: torch.Tensor) -> torch.Tensor:
    """[1 + R, ...] positions (the text positions over the R multimodal RoPE rows) -> the model's `position_ids`:
    as they are (Qwen-VL: [4, ...]), or the text positions alone for a model with 1-D positions (R = 0)."""
    return positions if positions.shape[0] > 1 else positions[0]


def pack(docs: list[MMDocument], seq_len: int, packing: bool) -> list[list[MMDocument]]:
    """Documents -> rows of documents: end to end in order, a document that does not fit starts a row."""
    rows: list[list[MMDocument]] = []
    used = seq_len
    for doc in docs:
        if not packing or used + len(doc.tokens) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += len(doc.tokens)
    return rows


def row_tensors(docs: list[MMDocument], seq_len: int, pad_id: int) -> dict[str, Any]:
    """One row: token tensors [seq_len] ([4, seq_len] positions) and its vision inputs in token order."""
    ids = [t for d in docs for t in d.tokens]
    text_pos = [p for d in docs for p in range(len(d.tokens))]
    labels = [y for d in docs for y in shifted_labels(d.tokens, d.learn)]
    mrope = torch.cat([d.positions for d in docs], dim=1)
    pad = seq_len - len(ids)
    # Padding continues the last document's positions (see spindle.data.text): never learned, and causal
    # attention keeps it out of the real tokens.
    text_pos += list(range(text_pos[-1] + 1, text_pos[-1] + 1 + pad))
    mrope = continued(mrope, pad)
    row: dict[str, Any] = {
        "input_ids": torch.tensor(ids + [pad_id] * pad),
        "position_ids": torch.cat([torch.tensor(text_pos)[None], mrope]),
        "shift_labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
        "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
    }
    vision = [v for d in docs for v in d.vision]
    row["vision"] = vision
    return row


class ConversationRows(Dataset):
    """Fixed rows; item i = the row's tensors (`TOKEN_KEYS`) + "vision" (list of `Vision`) + "index"."""

    def __init__(self, rows: list[dict[str, Any]], stats: MMStats):
        self.rows, self.stats = rows, stats

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.rows[index], "index": index}


def collate_vision(vision: list[Media]) -> dict[str, torch.Tensor]:
    """Media inputs in token order -> the model's keyword arguments (only the kinds present). Audio: the clips'
    frames zero-padded to the longest, `input_features` [clips, mel bins, frames] with the
    `feature_attention_mask` [clips, frames] that marks the real ones (what the stock processor returns,
    less the silent tail every clip shares)."""
    out: dict[str, torch.Tensor] = {}
    images = [v for v in vision if isinstance(v, Vision) and v.kind == "image"]
    videos = [v for v in vision if isinstance(v, Vision) and v.kind == "video"]
    clips = [
        a for v in vision for a in ([v.features] if isinstance(v, Audio) else [v.audio.features] if v.audio else [])
    ]
    if clips:
        frames = max(c.shape[1] for c in clips)
        out["input_features"] = torch.stack([torch.nn.functional.pad(c, (0, frames - c.shape[1])) for c in clips])
        out["feature_attention_mask"] = torch.stack([(torch.arange(frames) < c.shape[1]).long() for c in clips])
    if images:
        out["pixel_values"] = torch.cat([v.pixel_values for v in images])
        grids = [v.grid_thw for v in images if v.grid_thw is not None]
        assert len(grids) in (0, len(images)), "one model's images are all patched or all fixed-size"
        if grids:  # patched images (a fixed-size tower's have none)
            out["image_grid_thw"] = torch.stack(grids)
    if videos:
        out["pixel_values_videos"] = torch.cat([v.pixel_values for v in videos])
        grids = [v.grid_thw for v in videos if v.grid_thw is not None]
        assert len(grids) == len(videos), "every video has its patch grid"
        out["video_grid_thw"] = torch.stack(grids)
        if all(v.timestamps is None for v in videos):  # timestamped videos' models take no seconds per grid
            out["second_per_grid_ts"] = torch.tensor([v.second_per_grid for v in videos])
    return out


def collate_conversations(samples: list[dict[str, Any]], multiple: int = 1) -> dict[str, torch.Tensor]:
    """Rows -> [B, L] tensors, `position_ids` [4, B, L] (the model's layout; [B, L] for 1-D positions), L the
    longest row rounded up to `multiple` (`spindle.data.text.trim_padding`; the SP degree), the vision inputs of all
    rows in row-major token order (how the model fills them in), "index": [B]."""
    out = trim_padding({k: torch.stack([s[k] for s in samples]) for k in TOKEN_KEYS}, multiple)
    out["position_ids"] = model_positions(out["position_ids"].permute(1, 0, 2).contiguous())
    out.update(collate_vision([v for s in samples for v in s["vision"]]))
    out["index"] = torch.tensor([s["index"] for s in samples])
    return out


def build_conversation_dataset(
    path: str | Path,
    processor: VisionProcessor,
    seq_len: int,
    packing: bool = True,
    skip_bad_samples: bool = False,
) -> ConversationRows:
    docs, truncated, skipped = read_conversations(path, processor, seq_len, skip_bad_samples)
    tok = processor.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = [row_tensors(group, seq_len, pad_id) for group in pack(docs, seq_len, packing)]
    label_tokens = sum(int((r["shift_labels"] != IGNORE_INDEX).sum()) for r in rows)
    vision = [v for d in docs for v in d.vision]
    stats = MMStats(
        documents=len(docs),
        rows=len(rows),
        truncated=truncated,
        skipped=skipped,
        label_tokens=label_tokens,
        images=sum(v.kind == "image" for v in vision),
        videos=sum(v.kind == "video" for v in vision),
        audios=sum(v.kind == "audio" for v in vision),
    )
    return ConversationRows(rows, stats)
