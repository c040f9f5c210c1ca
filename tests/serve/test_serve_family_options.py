"""The server's bad-request table for family options, one for every DiT family in the registry: each
option the family declares (`FamilyOptions`) is a request field, and a wrong value is refused before it
is queued, naming the field: a value of the wrong type (422), one out of bounds (400, with the bounds and
the family), one its rule refuses (400, naming the field the rule needs), and an option the family does
not have (422). (The common fields: tests/serve/test_serve.py and test_serve_images.py.)"""

from __future__ import annotations

import re

import pytest

from spindle.api import load_generator
from spindle.contracts.options import needs_negative_prompt
from spindle.contracts.sampling import option_bounds
from spindle.registry import all_families
from spindle.serve import build_app
from tests.serve.test_serve import LiveServer, assert_error

FAMILIES = sorted(f.name for f in all_families() if f.kind == "dit")


def png_data_url() -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tiny_checkpoint):
    """(family record, a LiveServer over its tiny checkpoint, the route its requests go to, a valid body)."""
    from spindle.registry import get_family

    family = get_family(request.param)
    root = tiny_checkpoint(family.name)
    gen = load_generator(root, device="cpu")
    image = gen.spec.media == "image"
    edits = image and family.options.images[0] > 0  # an image-editing family: /v1/images/edits with an image
    route = "/v1/images/edits" if edits else "/v1/images/generations" if image else "/v1/videos"
    base = {"prompt": "x", "size": "32x32", "num_inference_steps": 2, **({} if image else {"num_frames": 5})}
    if edits:
        base["image"] = png_data_url()
    with LiveServer(build_app(gen, model_id=f"tiny-{family.name}", root=str(root))) as server:
        yield family, server, route, base


def test_family_option_errors_name_the_field(served):
    family, server, route, base = served
    c = server.client
    submitted = server.state.store.counters["submitted"]
    assert_error(c.post(route, json={**base, "strength": 0.5}), 422, "strength")  # not an option of any family
    for option in family.options.extra:
        name = option.name
        assert_error(c.post(route, json={**base, name: "lots"}), 422, name)
        if option.minimum is not None:
            low = option.minimum - 1
            err = assert_error(c.post(route, json={**base, "negative_prompt": "x", name: low}), 400, name)
            assert re.search(rf"{re.escape(option_bounds(option))} for {family.name}", err["message"]), err
        if option.rule is needs_negative_prompt:
            err = assert_error(c.post(route, json={**base, name: 3}), 400, name)
            assert "negative_prompt" in err["message"], err
    assert server.state.store.counters["submitted"] == submitted  # none of them was queued
