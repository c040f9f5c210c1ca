"""HTTP request/response schemas (pydantic 2), shaped like OpenAI's Images and Videos APIs.

Unknown request fields are refused (422 naming the field), except the OpenAI fields a stock client
may send, which are accepted and either honoured or refused with a 400 naming them when Spindle
cannot honour their value (e.g. `response_format="url"`, `quality="hd"`: `routes/images.py`).

Numbers are strict in JSON: a boolean or a numeric string (`true`, `"2"`) for `num_inference_steps`,
`n`, `seed`, `guidance_scale`, `num_frames` or a family option is a 422 naming the field, never read
as 1 or 2. A form body (multipart or urlencoded: what the openai client sends to `/v1/videos`) has
only text, so it is validated leniently (`ServeState.read_request`). `seconds` is the exception:
OpenAI's Videos API types it as a string (`"4"`), so it takes a number or a numeric string (not a
boolean).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from spindle.contracts.sampling import common_field

JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
TERMINAL_STATUSES = ("completed", "failed", "cancelled")


class GenerationRequest(BaseModel):
    """What every generation body carries: OpenAI's `prompt`, `model`, `size`, and the sampling
    extras Spindle accepts on top (all optional: the model's defaults), typed and bounded as the sampling
    schema's fields. The served family's options are added as fields per server from its schema
    (`spindle.infer.options.request_model`), strict like these."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # the field carrying the request's input image(s), if the route takes any (decoded in params.py)
    image_field: ClassVar[str | None] = None

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = None
    # the sampling fields a body carries as the engine does: their types and bounds are the sampling schema's
    # (`spindle.contracts.sampling`); upper bounds past them (steps, prompt length, ...) are the server's limits,
    # checked by the engine's validation
    negative_prompt: str | None = None
    num_inference_steps: int | None = common_field("num_inference_steps")
    guidance_scale: float | None = common_field("guidance_scale")
    seed: int | None = common_field("seed")
    # a LoRA adapter the server has loaded (GET /v1/loras), by name, and its strength (default 1)
    lora: str | None = common_field("lora")
    lora_scale: float | None = common_field("lora_scale")


class LoraChoice(BaseModel):
    """The adapter a generation ran with (in its response: `lora`)."""

    name: str
    scale: float


class ImageGenerationRequest(GenerationRequest):
    """`POST /v1/images/generations` (OpenAI Images API)."""

    n: int | None = Field(default=1, ge=1)
    response_format: Literal["b64_json", "url"] | None = "b64_json"
    output_format: Literal["png", "webp", "jpeg", "gif", "svg"] | None = None
    stream: bool | None = None
    # OpenAI's knobs: honoured at the values Spindle can honour, refused with a 400 otherwise
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    output_compression: int | None = None
    partial_images: int | None = None
    # OpenAI's metadata (abuse monitoring, its moderation level): accepted, nothing here to apply it to
    user: str | None = None
    moderation: str | None = None
    safety_identifier: str | None = None


class ImageEditRequest(ImageGenerationRequest):
    """`POST /v1/images/edits` (OpenAI Images API): the generation fields plus the image(s) to edit."""

    file_fields: ClassVar[tuple[str, ...]] = ("image", "mask")  # multipart file parts taken (bodies.py)
    image_field: ClassVar[str | None] = "image"

    # one image or several (multipart `image` repeated, or `image[]` as the openai client sends a list), or
    # base64 data URLs in JSON; decoded and counted in params.py (every problem a 400 naming `image`)
    image: Any = Field(description="the image(s) to edit: multipart file uploads or 'data:image/png;base64,...' URLs")
    mask: Any = Field(default=None, description="not supported (no inpainting): a request with a mask is refused")
    input_fidelity: str | None = None  # OpenAI's knob: refused at any value (routes/edits.py)


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str = "png"
    size: str | None = None
    # Spindle extras
    model: str  # the served model's id (whatever alias the request named)
    seed: int | None = None
    lora: LoraChoice | None = None  # the adapter it ran with (None: the model alone)
    timings: dict[str, float] = Field(default_factory=dict)


class VideoCreateRequest(GenerationRequest):
    """`POST /v1/videos` (OpenAI Videos API; JSON, or the multipart form the openai client sends)."""

    # multipart file parts taken (bodies.py)
    file_fields: ClassVar[tuple[str, ...]] = ("input_reference", "last_image")
    image_field: ClassVar[str | None] = "input_reference"

    seconds: float | None = Field(default=None, gt=0, le=3600, allow_inf_nan=False, strict=False)
    num_frames: int | None = Field(default=None, ge=1)
    # OpenAI's image reference (image-to-video models): a multipart file, or a base64 data URL in JSON;
    # decoded and checked in params.py (every problem a 400 naming this field)
    input_reference: Any = Field(
        default=None,
        description="the conditioning image (image-to-video models): a multipart file upload or a "
        "'data:image/png;base64,...' URL",
    )
    # Spindle extra: the last frame of a first-last-frame model (Wan FLF2V), as input_reference is the first
    last_image: Any = Field(
        default=None,
        description="the last frame's image (first-last-frame models, with input_reference): a multipart file "
        "upload or a 'data:image/png;base64,...' URL",
    )

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_not_a_boolean(cls, value: Any) -> Any:
        if isinstance(value, bool):  # lenient float parsing would read `true` as 1 s
            raise ValueError("Input should be a number of seconds or a numeric string, not a boolean")
        return value


class VideoError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """OpenAI's Video object plus Spindle's extras (frames, fps, seed, notes, queue position)."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: JobStatus
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str | None = None
    seconds: str
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    # Spindle extras
    num_frames: int | None = None
    fps: int | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    lora: LoraChoice | None = None  # the adapter it runs with (None: the model alone)
    queue_position: int | None = None
    notes: list[str] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    deleted: bool | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "spindle"
    # Spindle extras
    family: str
    media: str
    aliases: list[str] = Field(default_factory=list)  # other names a request's `model` may give it
    root: str | None = None
    limits: dict[str, Any] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoraRequest(BaseModel):
    """`POST /v1/loras` (and SGLang-diffusion's `POST /v1/set_lora`): load an adapter from the server's
    adapter folder (`--lora-dir`) under a name requests then give as `lora`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    lora_name: str = Field(
        validation_alias=AliasChoices("lora_name", "lora_nickname"),
        description="the adapter's name in requests (letters, digits, '_', '-'; SGLang-diffusion: lora_nickname)",
    )
    lora_path: str | None = Field(
        default=None,
        description="a .safetensors file or an adapter folder inside --lora-dir, relative to it (default: "
        "lora_name.safetensors or the folder lora_name)",
    )


class LoraCard(BaseModel):
    """A loaded adapter."""

    name: str
    object: Literal["lora"] = "lora"
    path: str  # relative to the adapter folder
    loaded_at: int
    last_used: int
    parameters: int  # LoRA tensor elements it holds
    in_use: int  # waiting or running requests that name it (it is not unloaded while > 0)
    max_text_length: int | None = None  # the text length it was trained with, when its export records it
