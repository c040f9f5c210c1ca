"""A reward computed by an HTTP service the operator runs (a large scorer on other machines).

Each request is a POST of JSON `{"prompts": [...], "images": [...], "columns": {...}}` (DiT models: each image a
base64 PNG, each video a list of base64 PNG frames) or `{"prompts", "completions", "columns"}` (language
models), for up to `batch_size` samples; the answer is `{"scores": [one number per sample]}`. At most
`concurrency` requests are in flight. A connection error, a timeout or a 5xx answer is retried `retries` times,
waiting `backoff_s`, doubled after each try; a 4xx answer is not (the request itself is wrong). A scorer that
stays down raises a `RewardError` naming the URL.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spindle.config import RewardKind, RewardSpec
from spindle.train.rewards.combine import RewardError
from spindle.train.rewards.images import png_base64


class HttpScorer:
    def __init__(self, cfg: RewardSpec, kind: RewardKind) -> None:
        if cfg.url is None:
            raise ValueError("HttpScorer needs a url")
        self.url = cfg.url
        self.kind = kind
        self.cfg = cfg

    def __call__(
        self, outputs: Sequence[Any], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]
    ) -> list[float]:
        size = self.cfg.batch_size
        chunks = [range(start, min(start + size, len(outputs))) for start in range(0, len(outputs), size)]
        with ThreadPoolExecutor(max_workers=min(self.cfg.concurrency, max(len(chunks), 1))) as pool:
            answers = list(pool.map(lambda rows: self._score(rows, outputs, prompts, columns), chunks))
        return [score for answer in answers for score in answer]

    def _score(
        self, rows: range, outputs: Sequence[Any], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]
    ) -> list[float]:
        key = "images" if self.kind == "dit" else "completions"
        body = {
            "prompts": [prompts[i] for i in rows],
            key: [png_base64(outputs[i]) if self.kind == "dit" else outputs[i] for i in rows],
            "columns": {k: [v[i] for i in rows] for k, v in columns.items()},
        }
        scores = self._post(json.dumps(body).encode())
        if not isinstance(scores, list) or len(scores) != len(rows):
            raise RewardError(
                f"reward scorer at {self.url} answered {len(scores) if isinstance(scores, list) else 'no'} scores "
                f'for {len(rows)} samples; it must answer {{"scores": [one number per sample]}}'
            )
        return scores

    def _post(self, data: bytes) -> Any:
        wait = self.cfg.backoff_s
        tries = self.cfg.retries + 1
        last = ""
        for attempt in range(tries):
            request = urllib.request.Request(
                self.url, data=data, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode("utf-8", "replace")
                if e.code < 500:
                    raise RewardError(f"reward scorer at {self.url} refused the request: HTTP {e.code} {detail}") from e
                last = f"HTTP {e.code} {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                last = f"timed out after {self.cfg.timeout_s:g}s" if isinstance(reason, TimeoutError) else str(reason)
            except json.JSONDecodeError as e:
                raise RewardError(f"reward scorer at {self.url} answered something that is not JSON: {e}") from e
            else:
                if not isinstance(answer, dict) or "scores" not in answer:
                    raise RewardError(
                        f"reward scorer at {self.url} answered {str(answer)[:200]}; it must answer "
                        '{"scores": [one number per sample]}'
                    )
                return answer["scores"]
            if attempt + 1 < tries:
                time.sleep(wait)  # backoff before the next try: a restarting scorer gets time to come back
                wait *= 2
        raise RewardError(
            f"reward scorer at {self.url} failed {tries} tries ({last}); check that it is running and reachable "
            "from every training node"
        )
