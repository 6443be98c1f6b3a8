"""Where a Flow's durable state and run reports live: binary blobs under keys of one object.

In a pod that object is the ConfigMap ``<flow>-state``, reached only through the operator's state
API (``StateApiStore``). ``FileStore`` stands in for it in unit tests and local runs.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import ssl
import tempfile
import time
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

import httpx

from flowkube_api import constants as c
from flowkube_api.base import money_text
from flowkube_api.constants import STATE_LIMIT
from flowkube_api.report import Charge

KEY_PATTERN = re.compile(c.STATE_KEY_PATTERN)


class StoreError(Exception):
    """The state object could not be read or written (API unreachable, forbidden, missing)."""


STATE_ADVICE = "keep large data out of flow state (store a reference instead)"


class StateTooLarge(Exception):
    def __init__(self, size: int, limit: int, advice: str = STATE_ADVICE) -> None:
        super().__init__(f"flow state is {size} bytes gzip-compressed, over the {limit}-byte limit of one "
                         f"ConfigMap; {advice}")
        self.size = size
        self.limit = limit


class StateCorrupt(Exception):
    pass


class StateStore(Protocol):
    """Binary values by key inside the Flow's one state object."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes, *, leader_for: float | None = None) -> None:
        """Store ``value``. A replica that stored it but does not reconcile answers so; the value is
        sent again for ``leader_for`` seconds (None: for as long as any failure is retried)."""


class QuotaRefused(Exception):
    """A spend quota refused a model call: the message names the quota, its limit, the use and the reset."""


class MessageGone(Exception):
    """No message will come to this pod: its run was closed, or the conversation ended."""


class Inbox(Protocol):
    """Where a warm runner waits: for a conversation's next message, or a feedback answer."""

    def next_message(self, after: int, wait: float) -> dict[str, Any] | None:
        """Message ``after + 1`` as ``{"turn", "text", "sender"}``, or None if none came within about
        ``wait`` seconds. Raises ``MessageGone``."""
        ...

    def next_answer(self, request_id: str, wait: float) -> dict[str, Any] | None:
        """The answer to feedback request ``request_id`` as ``{"requestId", "text", "timedOut",
        "outcome"}``, or None if none came within about ``wait`` seconds. Raises ``MessageGone``."""
        ...


def encode_json(document: Any, limit: int = STATE_LIMIT) -> bytes:
    """gzip JSON, refusing (not truncating) anything over ``limit`` compressed bytes."""
    data = gzip.compress(json.dumps(document, separators=(",", ":")).encode("utf-8"), mtime=0)
    if len(data) > limit:
        raise StateTooLarge(len(data), limit)
    return data


def decode_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(gzip.decompress(data))
    except (OSError, EOFError, ValueError) as e:
        raise StateCorrupt(f"{what} is not gzip-compressed JSON: {e}") from e


class FileStore:
    """One file per key in a directory; writes are atomic renames like a ConfigMap update."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if "/" in key or key in ("", ".", ".."):
            raise StoreError(f"invalid key {key!r}")
        return self.directory / key

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def next_message(self, after: int, wait: float) -> dict[str, Any] | None:
        """Development only: the next message of a warm conversation is the file
        ``message.<after + 1>.json`` (``{"turn", "text"}``) that someone writes into the directory."""
        return self._poll_file(f"message.{after + 1}.json", wait)

    def next_answer(self, request_id: str, wait: float) -> dict[str, Any] | None:
        """Development only: the file ``answer.<request id>.json`` (``{"requestId", "text"}``)."""
        return self._poll_file(f"answer.{request_id}.json", wait)

    def _poll_file(self, name: str, wait: float) -> dict[str, Any] | None:
        path = self._path(name)
        deadline = time.monotonic() + wait
        while True:
            try:
                found = json.loads(path.read_text())
                return found if isinstance(found, dict) else None
            except (FileNotFoundError, ValueError):  # not there yet, or being written
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)  # a file has no long poll: look 20 times a second

    def put(self, key: str, value: bytes, *, leader_for: float | None = None) -> None:
        target = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
        with os.fdopen(fd, "wb") as fh:
            fh.write(value)
        Path(tmp).replace(target)


class StateApiStore:
    """binaryData keys of the Flow's state object, through the operator's state API.

    The runner holds no Kubernetes API credentials. It presents its pod-bound token (audience
    ``flowkube.io/state``); the operator authenticates it with a TokenReview, maps the pod to its
    Flow and reads or writes that Flow's ``<flow>-state`` ConfigMap, and nothing else.
    """

    def __init__(self, client: httpx.Client, *, retry_for: float = 300.0, refused_for: float = 30.0) -> None:
        self._client = client
        # An operator restart (a Recreate rollout, a crash) takes seconds to minutes; a run's
        # state and usage are never dropped for less. A refusal (401/403: the operator does not
        # yet know our pod, a TokenReview raced the pod's creation) gets a shorter grace.
        self._retry_for = retry_for
        self._refused_for = min(refused_for, retry_for)

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> StateApiStore:
        env = os.environ if env is None else env
        url = env.get(c.ENV_STATE_URL, "").strip()
        if not url:
            raise StoreError(f"{c.ENV_STATE_URL} is not set: the runner needs the operator's state API")
        ca = env.get(c.ENV_STATE_CA, "").strip()
        try:
            verify: ssl.SSLContext | bool = ssl.create_default_context(cadata=ca) if ca else True
        except ssl.SSLError as e:
            raise StoreError(f"{c.ENV_STATE_CA} is not a PEM certificate: {e}") from e
        token = Path(env.get(c.ENV_STATE_TOKEN_FILE, "").strip() or f"{c.STATE_TOKEN_DIR}/token")
        try:
            retry_for = float(env.get(c.ENV_STATE_RETRY_SECONDS, "") or 300)
        except ValueError as e:
            raise StoreError(f"{c.ENV_STATE_RETRY_SECONDS}: {e}") from e
        client = httpx.Client(base_url=url.rstrip("/"), verify=verify, auth=_BearerFile(token), timeout=15.0)
        return cls(client, retry_for=retry_for)

    def _request(self, method: str, key: str, leader_for: float | None = None, *, path: str | None = None,
                 refused_for: float | None = None, **kwargs: Any) -> httpx.Response:
        """``path`` (default: the state key's) is retried the same way; ``refused_for``: how long a
        401/403 is asked again (default: the store's)."""
        if path is None and not KEY_PATTERN.fullmatch(key):
            raise StoreError(f"invalid key {key!r}")
        refused_for = self._refused_for if refused_for is None else refused_for
        delay = 0.25
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start + delay
            try:
                response = self._client.request(method, path or c.STATE_API_PREFIX + key, **kwargs)
            except (httpx.TransportError, OSError) as e:
                if elapsed > self._retry_for:
                    raise StoreError(f"{method} state {key}: state API unreachable: {e}") from e
            else:
                code = response.status_code
                if code in (401, 403):
                    if elapsed > refused_for:
                        return response
                else:
                    # Stored by a replica that does not reconcile: sent again only for ``leader_for``.
                    stored = _stored_elsewhere(response) and leader_for is not None and elapsed > leader_for
                    if stored or (code < 500 and code not in (409, 429)) or elapsed > self._retry_for:
                        return response
            time.sleep(delay)
            delay = min(delay * 2, 4.0)

    def get(self, key: str) -> bytes | None:
        response = self._request("GET", key)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise StoreError(f"GET state {key}: {_status_text(response)}")
        return response.content

    def put(self, key: str, value: bytes, *, leader_for: float | None = None) -> None:
        response = self._request("PUT", key, leader_for, content=value,
                                 headers={"Content-Type": "application/octet-stream"})
        if response.status_code == 413:
            raise StateTooLarge(len(value), STATE_LIMIT)
        if response.status_code not in (200, 204) and not (leader_for is not None and _stored_elsewhere(response)):
            raise StoreError(f"PUT state {key}: {_status_text(response)}")

    def reserve(self, model: str, tokens: int, cost: Decimal | None, *, charges: list[Charge] | None = None,
                held: list[tuple[int, str, int, Decimal]] | None = None) -> int:
        """A model call's worst case, reserved under the Flow's spend quotas (its id; 0: no quota
        covers the Flow, or the operator enforces none); ``cost`` None: the model has no price.
        ``charges`` (the run's so far) and ``held`` (its other reservations in flight) let a new
        leader know what this pod has. Raises ``QuotaRefused``; a 503 (a follower, a leader
        recovering its book) is asked again."""
        body = {"model": model, "tokens": tokens, "cost": money_text(cost or Decimal(0)), "priced": cost is not None,
                "charges": _charges_json(charges), "held": _held_json(held)}
        # A refusal of our token (an operator that has just started and does not know this pod yet) is
        # waited out as long as an operator restart: a settle given up would leave a new leader
        # waiting for this pod, and a reserve given up fails the call.
        response = self._request("POST", "reserve", path=f"{c.QUOTA_API_PREFIX}reserve", json=body,
                                 refused_for=self._retry_for)
        if response.status_code == 402:
            raise QuotaRefused(_status_text(response).removeprefix("HTTP 402 "))
        if response.status_code == 404:
            return 0
        if response.status_code != 200:
            raise StoreError(f"POST quota reserve: {_status_text(response)}")
        return int(response.json()["id"])

    def settle(self, reservation: int, charges: list[Charge] | None, *,
               held: list[tuple[int, str, int, Decimal]] | None = None) -> None:
        """The call answered: its reservation freed, the run's charges so far recorded."""
        if reservation == 0:
            return
        body = {"id": reservation, "charges": _charges_json(charges), "held": _held_json(held)}
        response = self._request("POST", "settle", path=f"{c.QUOTA_API_PREFIX}settle", json=body,
                                 refused_for=self._retry_for)
        if response.status_code not in (204, 404):
            raise StoreError(f"POST quota settle: {_status_text(response)}")

    def hold(self, charges: list[Charge] | None, held: list[tuple[int, str, int, Decimal]]) -> None:
        """Remind the desk of the reservations held while their calls are in flight (a new leader
        learns of them within its recovery); asked again through an operator's restart."""
        body = {"charges": _charges_json(charges), "held": _held_json(held)}
        response = self._request("POST", "hold", path=f"{c.QUOTA_API_PREFIX}hold", json=body,
                                 refused_for=self._retry_for)
        if response.status_code not in (204, 404):
            raise StoreError(f"POST quota hold: {_status_text(response)}")

    def next_message(self, after: int, wait: float) -> dict[str, Any] | None:
        return self._long_poll(f"{c.MESSAGE_API_PREFIX}{after}", wait)

    def next_answer(self, request_id: str, wait: float) -> dict[str, Any] | None:
        return self._long_poll(f"{c.ANSWER_API_PREFIX}{request_id}", wait)

    def _long_poll(self, path: str, wait: float) -> dict[str, Any] | None:
        """The operator answers as soon as what the pod waits for is accepted for it. An operator that
        is away (a restart, a rollout) is waited out: the window goes on."""
        try:
            response = self._client.get(path, params={"wait": f"{wait:.1f}"}, timeout=wait + 15.0)
        except (httpx.TransportError, OSError):
            time.sleep(min(1.0, wait))  # the operator is away: ask again in a moment
            return None
        code = response.status_code
        if code == 200:
            found = response.json()
            return found if isinstance(found, dict) else None
        if code == 204:
            return None
        if code >= 500 or code == 429:
            time.sleep(min(1.0, wait))
            return None
        raise MessageGone(_status_text(response))


def _charges_json(charges: list[Charge] | None) -> list[dict[str, Any]]:
    return [ch.model_dump(mode="json", by_alias=True) for ch in charges or []]


def _held_json(held: list[tuple[int, str, int, Decimal]] | None) -> list[dict[str, Any]]:
    """At most 64: what the operator takes of them (a pod holds far fewer)."""
    return [{"id": i, "model": m, "tokens": t, "cost": money_text(cost)} for i, m, t, cost in (held or [])[:64]]


def _status_text(response: httpx.Response) -> str:
    try:
        message = response.json().get("message", "")
    except ValueError:
        message = response.text[:200]
    return f"HTTP {response.status_code} {message}".strip()


class _BearerFile(httpx.Auth):
    """Re-reads the projected token per request: kubelet rotates it under a long-running pod."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def auth_flow(self, request: httpx.Request) -> Any:
        try:
            token = self._path.read_text().strip()
        except OSError as e:
            raise StoreError(f"no state API token at {self._path}: {e}") from e
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


def _stored_elsewhere(response: httpx.Response) -> bool:
    """Stored by an operator replica that does not reconcile (it asks for the value again)."""
    return response.status_code == 503 and response.headers.get(c.HEADER_STORED) == "true"
