"""A small client for RunPod's REST API v2 (https://api.runpod.io/v2; v1 was retired on 2026-11-15).

Bodies and answers are plain dicts in RunPod's own shapes (the OpenAPI document's
`CreatePodRequest`, `Pod`, `CreateClusterRequest`, `Cluster`, `DataCenter`, `GpuType`):
the provider builds them, this module only moves them and turns failures into
:class:`RunPodError` s that carry RunPod's problem+json `title`/`detail`.

Transient failures are retried, bounded by attempts and a total deadline, and every
wait is reported through ``progress``: 429 waits ``Retry-After`` (one past the deadline is
said as RunPod's own ask); 5xx and connection errors back off exponentially. A create
whose answer was a 5xx, or whose connection broke after it was sent, may have been made:
it is looked for by name before it is sent again, and never sent twice blind.

A pod's log stream (``pod_logs``) goes on until the pod ends: a quiet stream, a dropped
one and one that ends while the pod runs are all resumed, without losing or repeating a
line, because the document promises no keep-alive, no end of stream and no resume rule.

The API key is only ever put in the ``Authorization`` header. It is kept out of every
exception, repr and progress message, even when RunPod echoes it back; so is every secret
value sent to ``create_secret`` (the one request that carries a value: RunPod's account
secrets, which pods reference by name).

``httpx`` is imported when the first request is made, so importing this module
(and ``rlhf-tasks --help``) stays fast.
"""

from __future__ import annotations

import email.utils
import json
import os
import queue
import re
import socket
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, NamedTuple

DEFAULT_URL = "https://api.runpod.io/v2"
ACTIONS = ("start", "stop", "restart", "terminate")
ENDED = ("EXITED", "ERROR", "TERMINATED")  # a pod's statuses after its container ran

Progress = Callable[[str], None]
Pod = dict[str, Any]
Cluster = dict[str, Any]


class RunPodError(Exception):
    """RunPod refused a request, or could not be reached. ``status`` is None when no
    HTTP answer came; ``title``/``detail``/``errors`` are RunPod's problem+json fields."""

    def __init__(self, status: int | None, title: str, detail: str, *, method: str = "",
                 path: str = "", errors: list[str] | tuple[str, ...] = ()):
        self.status, self.title, self.detail = status, title, detail
        self.method, self.path, self.errors = method, path, list(errors)
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"RunPod API {self.method} {self.path}".rstrip()
        code = f"{self.status} " if self.status is not None else ""
        text = f"{where}: {code}{self.title}: {self.detail}"
        if self.errors:
            text += " [" + "; ".join(self.errors) + "]"
        return text


class RunPodAuthError(RunPodError):
    """401/403: the key is missing, wrong or expired, or lacks access (on a create: the
    account cannot use that pool, which another data center or GPU type may not share)."""

    def _message(self) -> str:
        if self.status == 403 and self.method == "POST" and self.path in ("/pods", "/clusters"):
            # RunPod on POST /pods: "403 | Your account cannot access the requested pool. |
            # Skip this candidate, keep going." The key itself is fine.
            why = "the account cannot access the requested pool (GPU type, cloud or data center)"
        elif self.status == 403:
            why = "the RunPod API key lacks access to this resource or action"
        else:
            why = "the RunPod API key is missing, wrong or expired (set RUNPOD_API_KEY)"
        code = f"{self.status} " if self.status is not None else ""
        return f"RunPod API {self.method} {self.path}: {why} ({code}{self.title}: {self.detail})"


class RunPodNotFound(RunPodError):
    """404: no such pod or cluster (or not visible to this key)."""


class RunPodUnavailable(RunPodError):
    """Retries ran out (429, 5xx, connection errors) or a sent POST lost its answer.
    ``retry_after``: the seconds RunPod asked to wait, when that was past the deadline."""

    retry_after: float | None = None


class LogLine(NamedTuple):
    """One line of a pod's log stream: ``source`` is "container" or "system"."""
    source: str
    line: str
    ts: str


_END = object()  # the pod ended and its log is all read


class RunPodClient:
    """RunPod REST API v2. ``api_key`` comes from the caller (the CLI reads RUNPOD_API_KEY);
    ``base_url`` defaults to ``$RUNPOD_API_URL`` or https://api.runpod.io/v2."""

    def __init__(self, api_key: str | None, *, base_url: str | None = None,
                 progress: Progress | None = None, max_attempts: int = 5,
                 deadline: float = 300.0, backoff: float = 1.0, max_backoff: float = 30.0,
                 timeout: float = 30.0):
        self.base_url = (base_url or os.environ.get("RUNPOD_API_URL") or DEFAULT_URL).rstrip("/")
        self._key = api_key or ""
        if not self._key:
            raise RunPodAuthError(None, "Unauthorized", "no API key given (RUNPOD_API_KEY is empty)")
        self._progress = progress
        self.max_attempts = max(1, max_attempts)
        self.deadline = deadline
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.timeout = timeout
        self._http = None
        self._lock = threading.Lock()
        self._hidden: set[str] = set()  # secret values sent (create_secret): scrubbed like the key

    @classmethod
    def from_env(cls, **kwargs) -> "RunPodClient":
        """Key from RUNPOD_API_KEY, URL from RUNPOD_API_URL."""
        return cls(os.environ.get("RUNPOD_API_KEY"), **kwargs)

    def __repr__(self) -> str:
        return f"RunPodClient({self.base_url!r})"

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> "RunPodClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ pods

    def create_pod(self, body: dict[str, Any]) -> Pod:
        """POST /pods (CreatePodRequest) -> the new Pod, status PROVISIONING. A 5xx or a lost
        answer is not sent again blind: a pod of that name made by it is returned instead."""
        before = {p["id"] for p in self.list_pods(body["name"], include_cluster_pods=True)}

        def made() -> Pod | None:
            return next((p for p in self.list_pods(body["name"], include_cluster_pods=True)
                         if p["name"] == body["name"] and p["id"] not in before), None)

        return self._json("POST", "/pods", body=body, ok=(200, 201), made=made)

    def get_pod(self, pod_id: str) -> Pod:
        """GET /pods/{id}. A terminated pod answers status TERMINATED, or RunPodNotFound."""
        return self._json("GET", f"/pods/{pod_id}")

    def list_pods(self, name_prefix: str | None = None, *,
                  include_cluster_pods: bool = False) -> list[Pod]:
        """GET /pods, filtered here by name prefix (the API has no name filter).
        Cluster members are left out unless ``include_cluster_pods``."""
        params = {"includeClusterPods": "true"} if include_cluster_pods else None
        pods = self._json("GET", "/pods", params=params)["pods"]
        if name_prefix is not None:
            pods = [p for p in pods if p.get("name", "").startswith(name_prefix)]
        return pods

    def pod_action(self, pod_id: str, action: str) -> Pod | None:
        """POST /pods/{id}/action: start|stop|restart return the Pod; terminate returns None."""
        if action not in ACTIONS:
            raise ValueError(f"pod action must be one of {', '.join(ACTIONS)}, not {action!r}")
        resp = self._request("POST", f"/pods/{pod_id}/action", body={"action": action},
                             ok=(200, 204))
        return None if resp.status_code == 204 or not resp.content else self._decode(resp)

    def delete_pod(self, pod_id: str, *, missing_ok: bool = True) -> bool:
        """DELETE /pods/{id}. False when it was already gone (and ``missing_ok``)."""
        return self._delete(f"/pods/{pod_id}", missing_ok)

    def pod_logs(self, pod_id: str, *, source: str | None = None, tail: int | None = None,
                 stop: threading.Event | None = None) -> Iterator[LogLine]:
        """Follow GET /pods/{id}/logs (Server-Sent Events) line by line, until the pod has
        ended and its last lines are read, ``stop`` is set (from any thread), or the caller
        stops iterating.

        RunPod's document promises less than a stream that lasts as long as the pod: no
        keep-alive comments, no word on when a stream ends, ids that are plain timestamps
        shared by many lines. So a stream that is quiet past the read timeout, drops, or
        ends is resumed (from an earlier timestamp, the lines already passed on skipped),
        and the pod's status decides whether it has ended; only drops are counted
        (``max_attempts`` in a row without a line between).
        """
        params: dict[str, Any] = {}
        if source is not None:
            params["source"] = source
        if tail is not None:
            params["tail"] = tail
        path = f"/pods/{pod_id}/logs"
        shown = self._scrub(path)
        lines: queue.Queue = queue.Queue()
        stopped = threading.Event()
        current: list[Any] = [None]  # the open response, so stop can cut its socket

        def read() -> None:
            import httpx

            cursor = _Cursor()
            drops = idle = 0
            draining = False  # the pod has ended: one more stream for its last lines
            try:
                while not stopped.is_set():
                    headers, query = cursor.reconnect(params)
                    try:
                        resp = self._request("GET", path, params=query, headers=headers,
                                             stream=True)
                    except RunPodNotFound:
                        if cursor.resumed or draining:
                            break  # the pod is gone, and its log with it
                        raise
                    current[0] = resp
                    passed = 0
                    try:
                        for _, data in _sse_events(resp.iter_lines()):
                            item = self._log_line(data, shown)
                            if item is not None and cursor.new(item):
                                lines.put(item)
                                passed += 1
                        how = "ended"
                    except httpx.ReadTimeout:
                        how = "quiet"  # no keep-alive is promised: quiet is not lost
                    except httpx.TransportError as exc:
                        how = f"dropped ({type(exc).__name__})"
                        error = exc
                    except Exception:  # noqa: BLE001 - a stop cuts the socket mid-read
                        if stopped.is_set():
                            return
                        raise
                    finally:
                        resp.close()
                    if stopped.is_set():
                        return
                    if not how.startswith("dropped"):
                        drops = 0  # only drops in a row, without a line between, count
                    else:
                        drops = drops + 1 if not passed else 1
                        if drops >= self.max_attempts:
                            raise RunPodUnavailable(
                                None, "Log stream lost", self._scrub(
                                    f"{type(error).__name__}: {error} ({drops} times in a row)"),
                                method="GET", path=shown) from None
                        wait = self._backoff(drops)
                        self._say(f"RunPod: log stream {path} {how}; resuming in {wait:.1f}s")
                        stopped.wait(wait)
                        continue
                    if draining:
                        break
                    # The document does not say when a stream ends, nor promises keep-alive
                    # comments: whether the pod has ended is its status's to say.
                    if self._pod_ended(pod_id):
                        draining = True
                        continue
                    idle = 0 if passed or how == "quiet" else idle + 1
                    if idle:  # ended at once with nothing new: do not hammer the API
                        stopped.wait(self._backoff(idle))
                lines.put(_END)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                lines.put(exc)

        reader = threading.Thread(target=read, name=f"runpod-logs-{pod_id}", daemon=True)
        reader.start()
        try:
            while True:
                if stop is not None and stop.is_set():
                    return
                try:
                    item = lines.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stopped.set()
            _cut(current[0])

    def _pod_ended(self, pod_id: str) -> bool:
        """Whether the pod has ended (gone counts); unknown is not ended."""
        try:
            return self.get_pod(pod_id).get("status") in ENDED
        except RunPodNotFound:
            return True
        except RunPodError:
            return False

    # -------------------------------------------------------------- clusters

    def create_cluster(self, body: dict[str, Any]) -> Cluster:
        """POST /clusters (CreateClusterRequest) -> the new Cluster. A 5xx or a lost answer is
        not sent again blind: a cluster of that name made by it is returned instead (two
        would both bill)."""
        before = {c["id"] for c in self.list_clusters() if c.get("name") == body["name"]}

        def made() -> Cluster | None:
            return next((c for c in self.list_clusters()
                         if c.get("name") == body["name"] and c["id"] not in before), None)

        return self._json("POST", "/clusters", body=body, ok=(200, 201), made=made)

    def get_cluster(self, cluster_id: str) -> Cluster:
        return self._json("GET", f"/clusters/{cluster_id}")

    def list_clusters(self) -> list[Cluster]:
        return self._json("GET", "/clusters")["clusters"]

    def cluster_pods(self, cluster_id: str) -> list[Pod]:
        """GET /clusters/{id}/pods: full Pods, each with ``cluster: {id, rank, ip}``."""
        return self._json("GET", f"/clusters/{cluster_id}/pods")["pods"]

    def delete_cluster(self, cluster_id: str, *, missing_ok: bool = True) -> bool:
        """DELETE /clusters/{id} (terminates every member pod)."""
        return self._delete(f"/clusters/{cluster_id}", missing_ok)

    # -------------------------------------------------------- network volumes

    def network_volume(self, volume_id: str) -> dict[str, Any]:
        """GET /network-volumes/{id}: its ``dataCenter`` (a volume lives in one) and size."""
        return self._json("GET", f"/network-volumes/{volume_id}")

    # -------------------------------------------------------------- secrets

    def create_secret(self, name: str, value: str, description: str | None = None) -> dict[str, Any]:
        """POST /account/secrets -> the Secret (its metadata: RunPod never returns a value). A 5xx
        or a lost answer is not sent again blind: a secret of that name made by it is returned."""
        before = {s["id"] for s in self.list_secrets(name)}

        def made() -> dict | None:
            return next((s for s in self.list_secrets(name) if s["id"] not in before), None)

        body = {"name": name, "value": value, **({"description": description} if description else {})}
        if len(value) >= 4:  # kept out of every message, as the key is, should RunPod echo it back (a shorter
            self._hidden.add(value)  # one would blank out letters of every word; nor is it much of a secret)
        return self._json("POST", "/account/secrets", body=body, ok=(200, 201), made=made)

    def list_secrets(self, name: str | None = None) -> list[dict[str, Any]]:
        """GET /account/secrets (``name``: only the secret of that name, matched case-insensitively)."""
        return self._json("GET", "/account/secrets", params={"name": name} if name else None)["secrets"]

    def delete_secret(self, secret_id: str, *, missing_ok: bool = True) -> bool:
        """DELETE /account/secrets/{id}. False when it was already gone (and ``missing_ok``)."""
        return self._delete(f"/account/secrets/{secret_id}", missing_ok)

    # --------------------------------------------------------------- catalog

    def datacenters(self, *, global_network: bool | None = None,
                    gpu_availability: bool = False) -> list[dict[str, Any]]:
        """GET /catalog/datacenters; ``global_network`` filters on the globalNetwork flag."""
        params: dict[str, Any] = {}
        if global_network is not None:
            params["globalNetwork"] = "true" if global_network else "false"
        if gpu_availability:
            params["include"] = "GPU_AVAILABILITY"
        return self._json("GET", "/catalog/datacenters", params=params)["dataCenters"]

    def gpu_types(self, *, availability: bool = False, product: str = "POD",
                  count: int | None = None, cloud: str | None = None) -> list[dict[str, Any]]:
        """GET /catalog/gpus: prices and maxCount per cloud; with ``availability``, current
        stock for ``product`` (POD or CLUSTER), ``count`` GPUs, on ``cloud``."""
        params: dict[str, Any] = {}
        if availability:
            params.update(include="AVAILABILITY", product=product)
            if count is not None:
                params["count"] = count
            if cloud is not None:
                params["cloud"] = cloud
        return self._json("GET", "/catalog/gpus", params=params)["gpus"]

    # -------------------------------------------------------------- plumbing

    def _client(self):
        with self._lock:
            if self._http is None:
                import httpx

                self._http = httpx.Client(
                    timeout=httpx.Timeout(self.timeout, connect=min(10.0, self.timeout)),
                    headers={"Accept": "application/json", "User-Agent": "rlhf-tasks"})
            return self._http

    def _json(self, method: str, path: str, *, body: Any = None,
              params: dict[str, Any] | None = None, ok: tuple[int, ...] = (200,),
              made: Callable[[], Any] | None = None) -> Any:
        resp = self._request(method, path, body=body, params=params, ok=ok, made=made)
        return resp if isinstance(resp, dict) else self._decode(resp)

    def _delete(self, path: str, missing_ok: bool) -> bool:
        try:
            self._request("DELETE", path, ok=(200, 202, 204))
        except RunPodNotFound:
            if not missing_ok:
                raise
            return False
        return True

    def _decode(self, resp) -> Any:
        try:
            return resp.json()
        except ValueError:
            path = self._scrub(str(resp.request.url)[len(self.base_url):])
            raise RunPodError(resp.status_code, "Unreadable answer",
                              self._scrub(f"expected JSON, got: {resp.text[:200]!r}"),
                              method=resp.request.method, path=path) from None

    def _request(self, method: str, path: str, *, body: Any = None,
                 params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                 ok: tuple[int, ...] = (200,), stream: bool = False,
                 made: Callable[[], Any] | None = None):
        """Send with retries; return the response (status in ``ok``) or raise RunPodError.
        ``made``: for a create, what it made despite a 5xx or a lost answer (or None),
        asked before the create is sent again; what it finds is returned instead."""
        import httpx

        client = self._client()
        url = self.base_url + path
        path = self._scrub(path)  # for messages (a caller could pass anything as an id)
        hdrs = dict(headers or {})
        hdrs["Authorization"] = f"Bearer {self._key}"
        start = time.monotonic()
        last: RunPodError | None = None
        attempt = 0
        for attempt in range(1, self.max_attempts + 1):
            request = client.build_request(method, url, json=body,
                                           params=params, headers=hdrs)
            try:
                resp = client.send(request, stream=stream)
            except httpx.TransportError as exc:
                sent = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                what = self._scrub(f"{type(exc).__name__}: {exc}")
                found = self._made(made, RunPodUnavailable(None, "No answer", what, method=method, path=path)) \
                    if method == "POST" and sent else None
                if found is not None:
                    return found
                if method == "POST" and sent:
                    raise RunPodUnavailable(
                        None, "No answer", f"{what}; the request was sent and may have been "
                        "applied: list before retrying", method=method, path=path) from None
                last = RunPodUnavailable(None, "Unreachable", f"could not reach {self.base_url} "
                                         f"({what})", method=method, path=path)
                wait, why = self._backoff(attempt), "backing off"
            else:
                if resp.status_code in ok:
                    return resp
                if stream:
                    resp.read()
                last = self._error(resp, method, path)
                if resp.status_code == 429 or resp.status_code >= 500:
                    after = _retry_after(resp.headers.get("Retry-After"))
                    if after is not None:
                        wait, why = after, "Retry-After"
                    else:
                        wait, why = self._backoff(attempt), "backing off"
                    resp.close()
                    if resp.status_code >= 500 and method == "POST":
                        found = self._made(made, last)
                        if found is not None:
                            return found
                else:
                    resp.close()
                    raise last
            if attempt == self.max_attempts:
                break
            elapsed = time.monotonic() - start
            if elapsed + wait > self.deadline:
                if why == "Retry-After":  # RunPod's own ask, not a failure to reach it
                    late = RunPodUnavailable(
                        last.status, last.title, f"RunPod asks to retry in {_span(wait)} "
                        f"(Retry-After: {wait:.0f}), past the {self.deadline:.0f}s deadline: "
                        "try again later", method=last.method, path=last.path,
                        errors=last.errors)
                    late.retry_after = wait
                    raise late
                raise self._gave_up(last, attempt, elapsed,
                                    f"the next wait ({wait:.1f}s, {why}) would pass the "
                                    f"{self.deadline:.0f}s deadline")
            code = f"{last.status} {last.title}" if last.status is not None else last.title
            self._say(f"RunPod: {method} {path}: {code}; retrying in {wait:.1f}s ({why}), "
                      f"attempt {attempt + 1} of {self.max_attempts}")
            time.sleep(wait)
        raise self._gave_up(last, attempt, time.monotonic() - start,
                            f"gave up after {attempt} attempts")

    def _made(self, made: Callable[[], Any] | None, failed: RunPodError) -> Any:
        """What a create made although it ``failed`` (a 5xx, a lost answer); None: nothing.
        When that cannot be told, the create is not sent again: ``failed`` is raised."""
        if made is None:
            return None
        try:
            found = made()
        except RunPodError as exc:
            raise RunPodUnavailable(
                failed.status, failed.title, f"{failed.detail}; it may have been made, and looking for "
                f"it failed too ({exc.status or ''} {exc.title}): list before retrying",
                method=failed.method, path=failed.path, errors=failed.errors) from None
        if found is not None:
            code = f"{failed.status} {failed.title}" if failed.status else failed.title
            self._say(f"RunPod: {failed.method} {failed.path}: {code}, but it was made: found "
                      f"{found.get('name')} ({found.get('id')}); not sending it again")
        return found

    def _gave_up(self, last: RunPodError | None, attempts: int, elapsed: float,
                 why: str) -> RunPodError:
        assert last is not None
        return RunPodUnavailable(last.status, last.title,
                                 f"{last.detail} ({why}, {elapsed:.1f}s)", method=last.method,
                                 path=last.path, errors=last.errors)

    def _error(self, resp, method: str, path: str) -> RunPodError:
        """RunPod's problem+json as an exception (any other body is summarised)."""
        status = resp.status_code
        title, detail, errors = resp.reason_phrase or "Error", "", []
        try:
            problem = resp.json()
        except ValueError:
            problem = None
        if isinstance(problem, dict):
            title = str(problem.get("title") or title)
            detail = str(problem.get("detail") or "")
            errors = [str(e) for e in problem.get("errors") or []]
        else:
            detail = resp.text[:300].strip()
        title, detail = self._scrub(title), self._scrub(detail or "(no detail)")
        errors = [self._scrub(e) for e in errors]
        cls = (RunPodAuthError if status in (401, 403) else RunPodNotFound if status == 404
               else RunPodError)
        return cls(status, title, detail, method=method, path=path, errors=errors)

    def _log_line(self, data: str, path: str) -> LogLine | None:
        try:
            event = json.loads(data)
            return LogLine(str(event["source"]), str(event["line"]), str(event["ts"]))
        except (ValueError, KeyError, TypeError):
            self._say(self._scrub(f"RunPod: {path}: skipped an unreadable log event: {data[:200]!r}"))
            return None

    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 1))

    def _say(self, message: str) -> None:
        if self._progress is not None:
            self._progress(self._scrub(message))

    def _scrub(self, text: str) -> str:
        for hidden in sorted(self._hidden | {self._key}, key=len, reverse=True):
            if hidden:
                text = text.replace(hidden, "***")
        return text


def _span(seconds: float) -> str:
    """A wait in words: "45 s", "12 min", "2 h"."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200 and seconds % 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.3g} h"


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: an integer, or an HTTP date (RFC 9110)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class _Cursor:
    """Where a resumed log stream starts, and which of its lines were passed on already.

    RunPod: "Log-event `id` values are the event `ts` timestamp", and `Last-Event-ID` is
    "a timestamp emitted by this endpoint"; whether a resume sends that timestamp's lines
    again is not said, and many lines can share one. So a resume starts from the timestamp
    before the last one passed on (read either way, it sends every line of the last), and
    skips the lines older than the last and, of the last one's, those up to the end of the run
    that was passed on (matched as a sequence, so that a line repeated inside the run cannot
    lose the place: a first stream's `tail` may have begun inside the run; where the run occurs
    more than once, its first occurrence is taken, which may repeat lines but never loses one).
    Without an earlier timestamp (every line so far has the same one) it resumes with
    ``since`` ("RFC3339 timestamp to resume from", any one) a second before the last; before
    the first line, from the beginning (``since`` the epoch): asking for the `tail` again would
    cut the lines written between two streams beyond it.
    The lines come in timestamp order (what resuming by timestamp rests on).
    """

    def __init__(self) -> None:
        self.last: str | None = None       # the timestamp of the last line passed on
        self.resume_id: str | None = None  # the one before it
        self.run: list[tuple[str, str]] = []  # the lines passed on with timestamp `last`
        self.resumed = False               # this stream repeats lines up to the cursor
        self.matched = 0                   # of `run`, seen again so far in this stream
        self.fallback: list[int] = []      # `run`'s failure function (Knuth-Morris-Pratt)
        self.streams = 0                   # opened so far

    def reconnect(self, params: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
        """The headers and query of the next stream, which starts again from the cursor."""
        self.resumed, self.matched, self.streams = self.last is not None, 0, self.streams + 1
        self.fallback = _failure(self.run)
        headers = {"Accept": "text/event-stream"}
        if self.resume_id is not None:  # it "takes precedence over `since` and `tail`"
            return {**headers, "Last-Event-ID": self.resume_id}, params
        if self.last is None:  # nothing passed on yet: the first stream as asked, then from the start
            return headers, params if self.streams == 1 else {**_without_tail(params), "since": EPOCH}
        since = _second_before(self.last)
        if since is None:
            return headers, params
        return headers, {**_without_tail(params), "since": since}

    def new(self, item: "LogLine") -> bool:
        """Pass this line on (True), or it was passed on before (False)."""
        key = (item.source, item.line)
        order = 1 if self.last is None else _ts_order(item.ts, self.last)
        if self.resumed and order < 0:
            return False
        if order == 0 and self.resumed:  # skip up to the end of the run passed on
            while self.matched and key != self.run[self.matched]:
                self.matched = self.fallback[self.matched - 1]
            if key == self.run[self.matched]:
                self.matched += 1
            self.resumed = self.matched < len(self.run)
            return False
        if order == 0:
            self.run.append(key)
        elif order > 0:
            self.resume_id, self.last, self.run = self.last, item.ts, [key]
            self.resumed = False
        return True  # (older than the last in a live stream: RunPod's clock; passed on)


#: Where a resume before the first line starts: every line the pod has logged.
EPOCH = "1970-01-01T00:00:00Z"


def _without_tail(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != "tail"}


def _failure(run: list) -> list[int]:
    """For each prefix of `run`, the length of its longest proper prefix that is also its suffix."""
    table, k = [0] * len(run), 0
    for i in range(1, len(run)):
        while k and run[i] != run[k]:
            k = table[k - 1]
        if run[i] == run[k]:
            k += 1
        table[i] = k
    return table


def _ts_order(a: str, b: str) -> int:
    """-1, 0, 1 as RFC 3339 timestamp ``a`` is before, at, after ``b`` (any fraction
    digits, any offset); unreadable ones compare as text."""
    ka, kb = _ts_key(a), _ts_key(b)
    if ka is None or kb is None:
        ka, kb = a, b
    return (ka > kb) - (ka < kb)


def _second_before(ts: str) -> str | None:
    """RFC 3339 timestamp ``ts`` less one second, in UTC (None: unreadable)."""
    key = _ts_key(ts)
    if key is None:
        return None
    text = datetime.fromtimestamp(key[0] - 1, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{key[1][:6]}Z"


def _ts_key(ts: str) -> tuple[int, str] | None:
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", ts.strip())
    if match is None:
        return None
    base, fraction, zone = match.groups()
    try:
        when = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    except ValueError:
        return None
    return int(when.timestamp()), (fraction or "").ljust(12, "0")


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(id, data) per Server-Sent Event (WHATWG: data lines joined, comments skipped)."""
    data: list[str] = []
    event_id = None
    for line in lines:
        if line == "":
            if data:
                yield event_id, "\n".join(data)
            data, event_id = [], None
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "id":
            event_id = value
    if data:
        yield event_id, "\n".join(data)


def _cut(resp) -> None:
    """Unblock a reader stuck in recv() on ``resp`` (closing alone does not), then close it."""
    if resp is None:
        return
    try:
        sock = resp.extensions["network_stream"].get_extra_info("socket")
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except Exception:  # noqa: BLE001 - best effort: the stream may be gone already
        pass
    try:
        resp.close()
    except Exception:  # noqa: BLE001
        pass
