"""Hugging Face repo ids where a model path is taken: `org/name` (optionally `org/name@revision`) -> the
snapshot folder in the local Hugging Face cache, as `from_pretrained("org/name")` finds it.

`resolve_model_path(value)` is the one resolver every entry point calls (`model.path` of a training job,
`--model` of generate / serve, `spindle.load_generator`, and any later model folder: a DPO reference
model, a reward model). It is offline-first and never downloads: a local folder is used as it is (it wins
over a repo id of the same spelling); an id is looked up in the cache with `huggingface_hub`
(`snapshot_download(..., local_files_only=True)`: the `refs/<revision>` pointer, then
`snapshots/<commit>/`), so `HF_HUB_OFFLINE=1` or no network changes nothing; an id that is not cached is
a `FileNotFoundError` of one line naming it and the command that downloads it.

The cache is the one huggingface_hub uses, read when resolving (so a changed environment counts):
`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# huggingface_hub's repo id rule: `name` or `org/name`, letters, digits, `-`, `_`, `.`; Spindle takes
# `org/name` only (a bare name is far likelier a local folder); `@revision` is a branch, tag or commit
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]+))?$")


def hub_cache() -> Path:
    """The Hugging Face hub cache folder huggingface_hub reads, from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def parse_repo_id(value: str | os.PathLike[str]) -> tuple[str, str | None] | None:
    """`org/name[@revision]` -> (repo id, revision or None); None for anything that is not spelt as one."""
    if not isinstance(value, str):
        return None
    m = _REPO_ID.match(value)
    if m is None or value.endswith((".json", ".yaml", ".yml", ".safetensors")):
        return None
    return m.group("repo"), m.group("revision")


def resolve_model_path(value: str | os.PathLike[str], what: str = "model") -> str:
    """A model folder: `value` itself when it exists locally or is not spelt as a repo id (the loader then
    names what is missing); else the cached snapshot of the Hugging Face repo `org/name[@revision]`.
    Raises `FileNotFoundError` (one line: the id, the cache searched, the download command) when the id is not
    cached. `what` names the setting in that message (`model.path`, `--model`)."""
    parsed = parse_repo_id(value)
    if parsed is None or Path(value).exists():
        return str(value)
    repo, revision = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache()
    try:
        return str(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        pass
    at = f" --revision {revision}" if revision else ""
    raise FileNotFoundError(
        f"{what} {value}: no such local folder, and Hugging Face model {repo}"
        f"{'@' + revision if revision else ''} is not in the local cache ({cache}); download it with "
        f"`hf download {repo}{at}` (or `huggingface-cli download {repo}{at}`), then run this again"
    )
