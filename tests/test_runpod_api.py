"""The RunPod REST API v2 boundary: our client (rlhf_tasks/providers/runpod/api.py) against
the local stand-in (tests/runpod_standin.py), which checks every request and every answer
against RunPod's own OpenAPI document. Fast tests run pods as local processes; the last
two run them on testbed hosts (root): Global Networking by name, Instant Cluster on ens1."""

from __future__ import annotations

import json
import threading
import time
from email.utils import formatdate

import pytest

import testbed as tbmod
from runpod_standin import (A40, H100, MI300X, Contract, ProcessRunner, RunPodStandIn,
                            TestbedRunner, b64_script_args)
from testbed import poll

from rlhf_tasks.providers.runpod.api import (LogLine, RunPodAuthError, RunPodClient,
                                             RunPodError, RunPodNotFound, RunPodUnavailable,
                                             _retry_after, _sse_events)

KEY = "rpa_TESTKEY_7f3c9e1d5b2a4c6e8f0a"  # distinctive: searched for in every message
testbed2 = tbmod.make_testbed_fixture(2)


@pytest.fixture
def standin(tmp_path):
    runner = ProcessRunner(tmp_path / "pods")
    api = RunPodStandIn(runner, api_key=KEY).start()
    yield api
    api.close()
    runner.close()
    assert api.errors == [], "the stand-in broke RunPod's contract or crashed"


@pytest.fixture
def progress():
    return []


@pytest.fixture
def client(standin, progress):
    c = RunPodClient(KEY, base_url=standin.url, progress=progress.append, backoff=0.02,
                     max_backoff=0.1)
    yield c
    c.close()


def pod_body(name="rt-pod", **extra):
    body = {"name": name, "image": "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04",
            "gpu": {"id": H100, "count": 2}, "cloud": "SECURE", "ports": ["22/tcp"],
            "env": {"PYTHONUNBUFFERED": "1"}}
    body.update(extra)
    return body


def log_lines(client, pod_id, prefixes, n, timeout=90.0):
    """The first ``n`` container log lines starting with one of ``prefixes``: reading stops
    once they are there (the pod may run on), when the pod ends, or at the deadline."""
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.start()
    found, seen = [], []
    try:
        for item in client.pod_logs(pod_id, source="container", stop=stop):
            seen.append(item.line)
            if item.line.startswith(prefixes):
                found.append(item.line)
                if len(found) == n:
                    return found
    finally:
        timer.cancel()
    tail = "\n".join(seen[-30:])
    raise AssertionError(f"pod {pod_id}: {len(found)} of {n} lines starting with {prefixes!r} "
                         f"{'by the deadline' if stop.is_set() else 'before it ended'}:\n{tail}")


def wait_status(client, pod_id, status, timeout=15.0):
    return poll(lambda: (p := client.get_pod(pod_id))["status"] == status and p, timeout,
                f"pod {pod_id} {status}", 0.05)


# ------------------------------------------------------------------ the contract itself


def test_contract_validator_accepts_runpods_examples_and_refuses_drift():
    """The validator is real: RunPod's own documented examples pass, a changed one fails."""
    contract = Contract()
    checked = 0
    for template, item in contract.doc["paths"].items():
        for method, op in item.items():
            if not isinstance(op, dict):
                continue
            for status in op.get("responses", {}):
                resp = contract.response(method, template, int(status) if status.isdigit() else 0)
                for content in (resp.get("content") or {}).values():
                    for example in (content.get("examples") or {}).values():
                        if "$ref" in content["schema"]:
                            assert contract.errors(content["schema"]["$ref"], example["value"]) == []
                            checked += 1
    assert checked > 100
    pod = contract.doc["paths"]["/v2/pods/{id}"]["get"]["responses"]["200"]["content"][
        "application/json"]["examples"]["pod"]["value"]
    assert contract.errors("Pod", dict(pod, status="BOOTING"))[0].startswith("$.status:")
    assert "$: 'globalNetworking' is a required property" in contract.errors(
        "Pod", {k: v for k, v in pod.items() if k != "globalNetworking"})
    assert contract.errors("Pod", dict(pod, podType="GPU"), strict=True)  # undocumented field
    assert contract.errors("Pod", dict(pod, podType="GPU")) == []  # (RunPod's schema is open)


def test_standin_refuses_to_send_an_answer_that_breaks_the_contract(standin, monkeypatch):
    """Its own drift is loud: a 500 naming the broken field, and a recorded error."""
    real = standin._pod_json
    monkeypatch.setattr(standin, "_pod_json", lambda pod: dict(real(pod), status="BOOTING",
                                                                   machineId="m-1"))
    client = RunPodClient(KEY, base_url=standin.url, max_attempts=1)
    with pytest.raises(RunPodError) as info:
        client.create_pod(pod_body())
    assert info.value.status == 500 and "$.status: 'BOOTING' is not one of" in info.value.detail
    assert "'machineId' was unexpected" in info.value.detail
    assert "POST /v2/pods -> 201" in standin.errors[0]  # (then the client looked for it: same again)
    standin.errors.clear()


# ------------------------------------------------------------------ pods


def test_pod_lifecycle_create_get_list_terminate(standin, client):
    created = client.create_pod(pod_body(
        "rt-life-0", globalNetworking=True, dataCenterIds=["EU-RO-1", "CA-MTL-1"],
        env={"PYTHONUNBUFFERED": "1", "GREETING": "hi there"},
        args="bash -c 'echo \"$GREETING from $RUNPOD_POD_ID in $RUNPOD_DC_ID\"; exec sleep 600'"))
    pod_id = created["id"]
    assert created["status"] == "PROVISIONING"
    assert created["dataCenterId"] is None  # "assigned by scheduler": not yet
    assert created["cost"] == 0.0  # not yet on a machine (the stand-in's least convenient reading)
    assert created["globalNetworking"] == {"enabled": False}  # no address yet
    assert created["ssh"]["direct"] is None

    pod = wait_status(client, pod_id, "RUNNING")
    assert pod["cost"] == pytest.approx(2 * 2.69 * 1.1)  # billed: not the catalog's list price x GPU count
    assert pod["dataCenterId"] == "EU-RO-1"  # the first preference (CA-MTL-1 is never tried)
    assert pod["globalNetworking"]["enabled"] is True
    assert pod["globalNetworking"]["internalDns"] == f"{pod_id}.runpod.internal"
    assert pod["globalNetworking"]["ip"]
    assert pod["ssh"]["direct"]["port"] == 22 and pod["ssh"]["proxy"]["host"] == "ssh.runpod.io"
    assert pod["runtime"]["ports"][0]["private"] == 22
    assert pod["startedAt"] and pod["actions"] == ["stop", "restart", "terminate"]
    assert log_lines(client, pod_id, "hi", 1) == [f"hi there from {pod_id} in EU-RO-1"]

    other = client.create_pod(pod_body("rt-other"))
    assert [p["id"] for p in client.list_pods("rt-life-")] == [pod_id]
    assert {p["id"] for p in client.list_pods()} == {pod_id, other["id"]}

    assert client.pod_action(pod_id, "terminate") is None
    gone = client.get_pod(pod_id)
    assert gone["status"] == "TERMINATED" and gone["cost"] == 0.0
    assert [p["id"] for p in client.list_pods()] == [other["id"]]
    process = standin.runner.pods[0].popen
    assert process.poll() is not None  # the container is really gone
    assert client.delete_pod(pod_id) is False  # already gone: fine for clean-up
    assert client.delete_pod(other["id"]) is True
    assert client.list_pods() == []


def test_stop_start_restart(standin, client):
    pod_id = client.create_pod(pod_body())["id"]
    wait_status(client, pod_id, "RUNNING")
    stopped = client.pod_action(pod_id, "stop")
    assert stopped["status"] == "EXITED" and stopped["cost"] == 0.0
    with pytest.raises(RunPodError) as info:
        client.pod_action(pod_id, "restart")
    assert info.value.status == 409 and "EXITED" in info.value.detail
    assert client.pod_action(pod_id, "start")["status"] == "PROVISIONING"
    wait_status(client, pod_id, "RUNNING")
    assert len(standin.runner.started) == 2
    assert client.pod_action(pod_id, "restart")["status"] == "PROVISIONING"
    wait_status(client, pod_id, "RUNNING")
    assert len(standin.runner.started) == 3


def test_invalid_body_is_refused_by_runpods_own_schema(standin, client):
    with pytest.raises(RunPodError) as info:
        client.create_pod(pod_body(gpuTypeId=H100))  # a v1 field: not in CreatePodRequest
    err = info.value
    assert err.status == 422 and err.title == "Unprocessable Entity"
    assert any(e.startswith("$: ") and "'gpuTypeId' was unexpected" in e for e in err.errors)
    assert "gpuTypeId" in str(err)

    with pytest.raises(RunPodError) as info:
        client.create_pod(pod_body(gpu={"id": H100, "count": 0}, ports="22/tcp"))
    assert "$.gpu.count: 0 is less than the minimum of 1" in info.value.errors
    assert "$.ports: '22/tcp' is not of type 'array'" in info.value.errors

    with pytest.raises(RunPodError) as info:
        client.create_pod({"name": "no-image", "gpu": {"id": H100}})
    assert "$: 'image' is a required property" in info.value.errors  # the if/then rule

    assert standin.pods == {} and standin.runner.started == []


def test_rules_beyond_the_schema_are_400s_with_runpods_detail(standin, client):
    cases = [
        (pod_body(gpu={"id": MI300X, "count": 1}, globalNetworking=True), "NVIDIA"),
        (pod_body(gpu={"id": H100, "count": 9}), "at most 8"),
        (pod_body(gpu={"id": A40, "count": 1}, dataCenterIds=["US-KS-2"]), "no capacity"),
        (pod_body(gpu={"id": "NVIDIA B300", "count": 1}), "does not exist"),
    ]
    for body, words in cases:
        with pytest.raises(RunPodError) as info:
            client.create_pod(body)
        assert info.value.status == 400 and words in info.value.detail, info.value


def test_nth_create_fails_with_the_chosen_problem(standin, client):
    standin.fail_create(2, 409, "Conflict", "no capacity for 2x H100 in EU-RO-1")
    client.create_pod(pod_body("rt-a"))
    with pytest.raises(RunPodError) as info:
        client.create_pod(pod_body("rt-b"))
    err = info.value
    assert (err.status, err.title, err.detail) == (409, "Conflict",
                                                   "no capacity for 2x H100 in EU-RO-1")
    assert str(err) == ("RunPod API POST /pods: 409 Conflict: no capacity for 2x H100 in EU-RO-1")
    client.create_pod(pod_body("rt-c"))
    assert [p["name"] for p in client.list_pods()] == ["rt-a", "rt-c"]


# ------------------------------------------------------------------ retries and errors


def test_429_waits_retry_after_then_retries(standin, client, progress):
    standin.rate_limit(1, retry_after=1)
    start = time.monotonic()
    assert client.list_pods() == []
    waited = time.monotonic() - start
    assert waited >= 1.0
    assert progress == ["RunPod: GET /pods: 429 Too Many Requests; retrying in 1.0s "
                        "(Retry-After), attempt 2 of 5"]
    assert [r.status for r in standin.requests] == [429, 200]


def test_retry_after_as_seconds_or_http_date():
    assert _retry_after("3") == 3.0
    assert 58 <= _retry_after(formatdate(time.time() + 60, usegmt=True)) <= 60
    assert _retry_after(formatdate(time.time() - 60, usegmt=True)) == 0.0
    assert _retry_after("soon") is None and _retry_after(None) is None


def test_5xx_is_retried_with_backoff_then_succeeds(standin, client, progress):
    standin.fail_requests(2, 503)
    assert client.list_pods() == []
    assert [r.status for r in standin.requests] == [503, 503, 200]
    assert [m.split(";")[0] for m in progress] == ["RunPod: GET /pods: 503 Service Unavailable"] * 2
    assert progress[1].endswith("(backing off), attempt 3 of 5")
    # a create is sent again only once it is clear that it made nothing (looked for by name)
    standin.requests.clear()
    progress.clear()
    standin.fail_create(1, 503, "Service Unavailable", "upstream temporarily unavailable")
    standin.fail_create(2, 503, "Service Unavailable", "upstream temporarily unavailable")
    pod = client.create_pod(pod_body())
    assert pod["status"] == "PROVISIONING" and len(standin.pods) == 1
    assert [(r.method, r.status) for r in standin.requests] == [("GET", 200), ("POST", 503), ("GET", 200),
                                                                ("POST", 503), ("GET", 200), ("POST", 201)]
    assert [m.split(";")[0] for m in progress] == ["RunPod: POST /pods: 503 Service Unavailable"] * 2


def test_retries_are_bounded_and_end_in_a_clear_error(standin, progress):
    client = RunPodClient(KEY, base_url=standin.url, progress=progress.append, max_attempts=3,
                          backoff=0.01)
    standin.fail_requests(10, 502, "Bad Gateway", "upstream connect error")
    with pytest.raises(RunPodUnavailable) as info:
        client.get_pod("abc")
    err = info.value
    assert err.status == 502 and len(standin.requests) == 3 and len(progress) == 2
    assert str(err).startswith("RunPod API GET /pods/abc: 502 Bad Gateway: upstream connect "
                               "error (gave up after 3 attempts, ")

    standin.clear_faults()
    standin.rate_limit(1, retry_after=3600)
    deadline_client = RunPodClient(KEY, base_url=standin.url, deadline=60)
    start = time.monotonic()
    with pytest.raises(RunPodUnavailable) as info:
        deadline_client.list_pods()
    assert time.monotonic() - start < 5  # did not sit out an hour
    assert "RunPod asks to retry in 1 h (Retry-After: 3600), past the 60s deadline" in str(info.value)


def test_connection_errors_are_retried_then_reported(progress):
    from rlhf_tasks.agent.protocol.ports import free_port

    port = free_port()  # a port nothing listens on
    client = RunPodClient(KEY, base_url=f"http://127.0.0.1:{port}/v2", progress=progress.append,
                          max_attempts=3, backoff=0.01)
    with pytest.raises(RunPodUnavailable) as info:
        client.datacenters()
    assert info.value.status is None and "ConnectError" in str(info.value)
    assert "gave up after 3 attempts" in str(info.value) and len(progress) == 2


def test_401_and_403_say_what_is_wrong_with_the_key(standin):
    with pytest.raises(RunPodAuthError) as info:
        RunPodClient("rpa_wrong", base_url=standin.url).list_pods()
    assert info.value.status == 401
    assert "RunPod API key is missing, wrong or expired (set RUNPOD_API_KEY)" in str(info.value)
    assert "invalid bearer token" in str(info.value)

    with pytest.raises(RunPodAuthError) as info:
        RunPodClient("", base_url=standin.url)
    assert "RUNPOD_API_KEY is empty" in str(info.value)
    assert standin.requests[-1].status == 401  # nothing sent without a key

    standin.auth_failure = 403
    with pytest.raises(RunPodAuthError) as info:
        RunPodClient(KEY, base_url=standin.url).get_pod("x")
    assert info.value.status == 403 and "lacks access" in str(info.value)
    standin.auth_failure = 401
    with pytest.raises(RunPodAuthError) as info:
        RunPodClient(KEY, base_url=standin.url).get_pod("x")
    assert info.value.status == 401 and len(standin.requests) == 3  # never retried


def test_403_on_create_is_a_pool_the_account_cannot_use_not_a_bad_key(standin, client):
    """RunPod: 403 on create: "Your account cannot access the requested pool"."""
    standin.forbidden = {"EU-RO-1"}
    with pytest.raises(RunPodAuthError) as info:
        client.create_pod(pod_body(dataCenterIds=["EU-RO-1"]))
    assert info.value.status == 403
    assert "the account cannot access the requested pool" in str(info.value)
    assert "key" not in str(info.value)


def test_a_retry_after_past_the_deadline_is_said_as_such(standin, progress):
    client = RunPodClient(KEY, base_url=standin.url, progress=progress.append, deadline=300)
    standin.rate_limit(1, retry_after=7200)
    start = time.monotonic()
    with pytest.raises(RunPodUnavailable) as info:
        client.create_pod(pod_body())
    assert time.monotonic() - start < 5
    assert info.value.retry_after == 7200
    assert ("RunPod API GET /pods: 429 Too Many Requests: RunPod asks to retry in 2 h "
            "(Retry-After: 7200), past the 300s deadline: try again later") in str(info.value)
    assert "could not reach" not in str(info.value) and standin.pods == {}


@pytest.mark.parametrize("kind", ["cluster", "pod"])
def test_a_5xx_on_a_create_that_was_made_leaves_one(standin, client, progress, kind):
    """A 5xx may come after the cluster (pod) was made: it is looked for by name before the
    create is sent again, so a retry never makes a second one (which would bill)."""
    standin.fail_create(1, 502, "Bad Gateway", "upstream timed out", kind=kind, made=True)
    if kind == "cluster":
        made = client.create_cluster({
            "name": "rt-once", "type": "TRAINING", "image": "runpod/pytorch:latest",
            "compute": {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2}})
        assert list(standin.clusters) == [made["id"]]
    else:
        made = client.create_pod(pod_body("rt-once"))
        assert list(standin.pods) == [made["id"]]
    assert made["name"] == "rt-once"
    assert [(r.method, r.status) for r in standin.requests if r.method == "POST"] == [("POST", 502)]
    assert any("found rt-once" in m for m in progress), progress


def test_404_is_its_own_error(standin, client):
    with pytest.raises(RunPodNotFound) as info:
        client.get_pod("nosuchpod")
    assert "pod nosuchpod not found" in str(info.value)
    assert client.delete_cluster("nosuchcluster") is False


def test_account_secrets_are_write_only_and_their_values_never_in_a_message(standin, client):
    """RunPod's vault (api-reference-v2/account): a name is unique (409), RUNPOD is a reserved prefix,
    no answer carries a value, and a value RunPod would echo back in an error is scrubbed like the key."""
    value = "hf_SECRETVALUE_0b1c2d3e"
    made = client.create_secret("rlhf-tasks.rt.HF_TOKEN", value, description="a test")
    assert made["name"] == "rlhf-tasks.rt.HF_TOKEN" and "value" not in made
    assert [s["id"] for s in client.list_secrets("RLHF-TASKS.rt.hf_token")] == [made["id"]]  # case-insensitive
    with pytest.raises(RunPodError) as taken:
        client.create_secret("rlhf-tasks.rt.HF_TOKEN", value)
    assert taken.value.status == 409 and value not in str(taken.value)
    with pytest.raises(RunPodError) as reserved:
        client.create_secret("runpod-mine", value)
    assert reserved.value.status == 400
    standin.fail_requests(1, 422, "Unprocessable Entity", f"value {value} is not allowed")  # an echo
    with pytest.raises(RunPodError) as echoed:
        client.list_secrets()
    assert value not in str(echoed.value) and "***" in str(echoed.value)
    assert value not in json.dumps([r.body for r in standin.requests if r.path != "/v2/account/secrets"])
    assert client.delete_secret(made["id"]) is True and client.delete_secret(made["id"]) is False
    assert client.list_secrets() == []


def test_the_api_key_never_appears_in_any_message(standin, tmp_path):
    """Every failure path, with RunPod even echoing the key back in its detail."""
    seen: list[str] = []
    make = lambda **kw: RunPodClient(KEY, base_url=standin.url, progress=seen.append,  # noqa: E731
                                     backoff=0.01, **kw)
    failures = []

    def fail(fn):
        with pytest.raises(RunPodError) as info:
            fn()
        failures.append(info.value)

    c = make(max_attempts=2)
    standin.fail_create(1, 400, "Bad Request", f"bad key {KEY} in request")  # an echo
    fail(lambda: c.create_pod(pod_body()))
    fail(lambda: c.create_pod(pod_body(bogus=KEY)))
    fail(lambda: c.create_pod(pod_body(name=KEY, gpu={"id": KEY, "count": 1})))
    standin.rate_limit(2, retry_after=0)
    fail(lambda: c.list_pods())
    standin.fail_requests(2, 500, "Internal Server Error", f"token {KEY} rejected upstream")
    fail(lambda: c.get_pod("x"))
    standin.auth_failure = 401
    fail(lambda: c.get_cluster("x"))
    standin.auth_failure = 403
    fail(lambda: c.list_clusters())
    standin.auth_failure = None
    fail(lambda: c.get_pod(KEY))
    dead = RunPodClient(KEY, base_url="http://127.0.0.1:9/v2", progress=seen.append,
                        max_attempts=2, backoff=0.01)
    fail(lambda: dead.gpu_types())

    texts = seen + [repr(c), repr(dead)]
    for exc in failures:
        texts += [str(exc), repr(exc), repr(exc.args), exc.title, exc.detail, *exc.errors,
                  repr(exc.__cause__), repr(exc.__context__)]
    assert len(failures) == 9 and len(seen) >= 3
    leaks = [t for t in texts if KEY in t]
    assert leaks == []
    assert any("***" in t for t in texts)  # the echo was there, and scrubbed


# ------------------------------------------------------------------ logs


def test_logs_stream_line_by_line_as_they_appear(standin, client, tmp_path):
    gate = tmp_path / "gate"
    script = (f"echo first; for i in $(seq 600); do [ -e {gate} ] && break; sleep 0.05; done; "
              "echo second; exit 3")
    pod_id = client.create_pod(pod_body(args=b64_script_args(script)))["id"]
    got = []
    for item in client.pod_logs(pod_id, source="container"):
        assert isinstance(item, LogLine) and item.source == "container"
        got.append(item.line)
        if item.line == "first":
            assert client.get_pod(pod_id)["status"] == "RUNNING"  # streamed, not replayed
            gate.touch()
    assert got == ["first", "second"]  # and the stream ended with the pod
    assert client.get_pod(pod_id)["status"] == "EXITED"
    assert standin.pod(pod_id).exit_code == 3

    # both sources, replayed with tail; the pod's lifecycle is in the system lines
    lines = list(client.pod_logs(pod_id))
    assert [(l.source, l.line) for l in lines if l.source == "container"] == [
        ("container", "first"), ("container", "second")]
    assert ("system", "container exited with code 3") in [(l.source, l.line) for l in lines]
    assert [l.line for l in client.pod_logs(pod_id, source="container", tail=1)] == ["second"]


def test_log_stream_stops_on_request_and_resumes_after_a_drop(standin, client, progress):
    pod_id = client.create_pod(pod_body(args="bash -c 'echo up; exec sleep 600'"))["id"]
    stop = threading.Event()
    got = []

    def follow():
        for item in client.pod_logs(pod_id, source="container", stop=stop):
            got.append(item.line)

    reader = threading.Thread(target=follow)
    reader.start()
    poll(lambda: got == ["up"], 10, "first log line", 0.02)
    stop.set()
    reader.join(5)
    assert not reader.is_alive()

    # a stream that breaks is resumed from the last event id: nothing lost, nothing twice
    script = "for i in 1 2 3 4 5; do echo line $i; done; exit 0"
    pod_id = client.create_pod(pod_body("rt-drop", args=b64_script_args(script)))["id"]
    wait_status(client, pod_id, "EXITED")
    standin.drop_log_stream_after = 2
    lines = [item.line for item in client.pod_logs(pod_id, source="container")]
    assert lines == [f"line {i}" for i in range(1, 6)]
    assert any("dropped (RemoteProtocolError)" in m for m in progress)
    assert 2 <= [r.path for r in standin.requests].count(f"/v2/pods/{pod_id}/logs") <= 3

    # SSE by hand: comments skipped, multi-line data joined, ids kept
    events = list(_sse_events(iter([": hi", "id: 1", "data: a", "data: b", "", "data: c"])))
    assert events == [("1", "a\nb"), (None, "c")]


def quiet_client(standin, progress, **kw):
    """A client whose read timeout is short, so a quiet stream shows in a second."""
    return RunPodClient(KEY, base_url=standin.url, progress=progress.append, timeout=0.4,
                        max_attempts=3, backoff=0.02, max_backoff=0.1, **kw)


def test_a_quiet_log_stream_is_not_a_lost_one(standin, progress):
    """RunPod promises no keep-alive comments: a pod that prints nothing for longer than the
    read timeout (a model download) is asked after, and the stream goes on, however long."""
    client = quiet_client(standin, progress)
    standin.stream_lifetime = None  # only quiet here
    pod_id = client.create_pod(pod_body(args="bash -c 'echo before; sleep 3; echo after'"))["id"]
    lines = [item.line for item in client.pod_logs(pod_id, source="container")]
    assert lines == ["before", "after"]
    asked = [r for r in standin.requests if r.method == "GET" and r.path == f"/v2/pods/{pod_id}"]
    assert len(asked) >= 3  # its status, while the stream was quiet
    assert not any("dropped" in m for m in progress)


@pytest.mark.parametrize("frozen", [False, True], ids=["ticking", "frozen-clock"])
@pytest.mark.parametrize("resume", ["after", "from"])
def test_a_resumed_log_stream_neither_loses_nor_repeats_a_line(standin, client, progress, resume,
                                                               frozen):
    """Event ids are plain timestamps, many lines share one, and the document does not say
    whether a resume from one sends its lines again: both readings, a line once each."""
    standin.resume = resume
    if frozen:  # every line has the same timestamp: no earlier one to resume from
        standin.clock = lambda: 1767225600.0
    script = ("echo 1; echo 2; echo 3; sleep 1.2; echo 4; echo 5; echo 6; sleep 1.2; echo 7; "
              "echo 8; echo 'RLHF_TASKS_RESULT {\"exit_code\": 0}'")
    pod_id = client.create_pod(pod_body(args=b64_script_args(script)))["id"]
    wait_status(client, pod_id, "EXITED", timeout=30)
    standin.drop_log_stream_after = 5
    lines = [item.line for item in client.pod_logs(pod_id, source="container")]
    assert lines == [*"12345678", 'RLHF_TASKS_RESULT {"exit_code": 0}']
    assert any("dropped (RemoteProtocolError)" in m for m in progress)


def test_the_resume_cursor_skips_exactly_what_was_passed_on():
    """By hand: a first stream whose `tail` began inside a run of lines with one timestamp, then a
    resume that sends the whole run again and a new line of that timestamp."""
    from rlhf_tasks.providers.runpod.api import _Cursor

    t1, t2 = "2026-06-01T12:02:03Z", "2026-06-01T12:02:04Z"
    cursor = _Cursor()
    first = [LogLine("container", x, t1) for x in ("b", "c")]  # "a" was before the tail
    assert [cursor.new(x) for x in first] == [True, True]
    headers, query = cursor.reconnect({"tail": 2})
    assert query == {"since": "2026-06-01T12:02:02.000000Z"} and "Last-Event-ID" not in headers
    again = [LogLine("container", x, t1) for x in ("a", "b", "c", "d")] + [LogLine("container", "e", t2)]
    assert [x.line for x in again if cursor.new(x)] == ["d", "e"]
    headers, query = cursor.reconnect({"tail": 2})
    assert headers["Last-Event-ID"] == t1 and query == {"tail": 2}  # (tail is ignored with it)
    assert [cursor.new(x) for x in again] == [False] * 5  # the "from" reading: all seen


def test_before_the_first_line_a_resume_starts_from_the_beginning():
    """With no line passed on, a resume cannot ask again for the last `tail` lines (or the
    server's default 100): lines written between two early streams would be cut (issue 32, 4b)."""
    from rlhf_tasks.providers.runpod.api import _Cursor

    for params in ({"tail": 100, "source": "container"}, {}):
        cursor = _Cursor()
        cursor.reconnect(params)  # the first stream: as asked
        headers, query = cursor.reconnect(params)  # it passed nothing on
        assert "Last-Event-ID" not in headers and "tail" not in query
        assert query["since"] == "1970-01-01T00:00:00Z" and query.get("source") == params.get("source")


def test_a_run_with_a_repeated_line_is_matched_as_a_sequence():
    """The first stream's `tail` began inside a run of one timestamp whose lines repeat: the
    resume sends the whole run again; what follows the part passed on is new, every line of it."""
    from rlhf_tasks.providers.runpod.api import _Cursor

    t1, t2 = "2026-06-01T12:02:03Z", "2026-06-01T12:02:04Z"
    for passed, whole, new in [(["x", "x", "y"], ["x", "x", "x", "y", "z", "x"], ["z", "x"]),
                               (["a", "b", "a", "b", "c"], ["a", "b", "a", "b", "a", "b", "c", "d"], ["d"]),
                               (["x", "x"], ["x", "x", "x"], ["x"])]:
        cursor = _Cursor()
        assert all(cursor.new(LogLine("container", x, t1)) for x in passed)
        cursor.reconnect({})
        again = [LogLine("container", x, t1) for x in whole] + [LogLine("container", "later", t2)]
        assert [x.line for x in again if cursor.new(x)] == new + ["later"], (passed, whole)


def test_lines_written_between_two_early_streams_are_all_read(standin, client, tmp_path):
    """150 lines written while no stream is open, after a first stream that passed nothing:
    the server's default tail is 100, so a resume that asks for the tail again loses 50."""
    standin.stream_lifetime = 0.3  # a stream ends on its own while the pod runs
    gate, done = tmp_path / "gate", tmp_path / "done"
    script = (f"for i in $(seq 600); do [ -e {gate} ] && break; sleep 0.05; done; seq 1 150; "
              f"for i in $(seq 600); do [ -e {done} ] && break; sleep 0.05; done; echo end")
    pod_id = client.create_pod(pod_body(args=b64_script_args(script)))["id"]
    wait_status(client, pod_id, "RUNNING")
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(i.line for i in client.pod_logs(pod_id, source="container")),
                              daemon=True)
    standin.log_streams_held = True  # the next stream waits before it reads the log
    reader.start()
    poll(lambda: standin.held_log_streams >= 1, 10, "the first stream held", 0.02)
    standin.log_streams_held = False  # the first stream: empty; it ends after 0.3 s
    poll(lambda: not standin.held_log_streams, 10, "the first stream let go", 0.02)
    standin.log_streams_held = True
    poll(lambda: standin.held_log_streams >= 1, 10, "the second stream held", 0.02)
    gate.touch()  # 150 lines while no stream is open
    poll(lambda: len([e for e in standin.pod(pod_id).logs if e.source == "container"]) >= 150, 10, "150 lines", 0.02)
    standin.log_streams_held = False
    poll(lambda: len(got) >= 150, 20, "150 lines read", 0.05)
    done.touch()
    reader.join(30)
    assert got == [str(i) for i in range(1, 151)] + ["end"]


def test_a_log_stream_that_ends_while_the_pod_runs_is_followed_on(standin, client):
    """The document does not say when a stream ends: a clean end is not the pod's end."""
    standin.stream_lifetime = 0.5
    pod_id = client.create_pod(pod_body(args="bash -c 'echo first; sleep 2; echo second; "
                                             "exec sleep 600'"))["id"]
    assert log_lines(client, pod_id, ("first", "second"), 2) == ["first", "second"]
    assert [r.path for r in standin.requests].count(f"/v2/pods/{pod_id}/logs") >= 3
    assert client.get_pod(pod_id)["status"] == "RUNNING"


# ------------------------------------------------------------------ clusters and catalog


def test_instant_cluster_pods_carry_ranks_and_overlay_ips(standin, client):
    body = {"name": "rt-cluster", "type": "TRAINING", "image": "runpod/pytorch:latest",
            "compute": {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2},
            "dataCenterIds": ["EU-RO-1"], "ports": ["22/tcp"], "env": {"PYTHONUNBUFFERED": "1"},
            "args": "bash -c 'echo rank=$NODE_RANK of $NUM_NODES primary=$PRIMARY_ADDR; exec sleep 600'"}
    cluster = client.create_cluster(body)
    assert cluster["compute"] == body["compute"]
    assert "dataCenterId" not in cluster  # RunPod: "omitted until at least one pod is placed"
    assert cluster["pods"]["total"] == 2
    pods = client.cluster_pods(cluster["id"])
    assert [p["cluster"]["rank"] for p in pods] == [0, 1]
    ips = [p["cluster"]["ip"] for p in pods]
    assert ips[0] != ips[1] and all(ip.startswith("10.78.") for ip in ips)
    assert all(p["cost"] in (0.0, pytest.approx(8 * 2.69 * standin.billed_rate)) for p in pods)  # 0.0: placing
    assert cluster["primary"]["podId"] == pods[0]["id"]

    for p in pods:
        wait_status(client, p["id"], "RUNNING")
    assert log_lines(client, pods[1]["id"], "rank=", 1) == [f"rank=1 of 2 primary={ips[0]}"]
    env = standin.runner.started[1]["env"]
    assert {k: env[k] for k in ("NODE_RANK", "NODE_ADDR", "PRIMARY_ADDR", "MASTER_ADDR",
                                "NUM_NODES", "NUM_TRAINERS", "WORLD_SIZE", "PRIMARY_PORT")} == {
        "NODE_RANK": "1", "NODE_ADDR": ips[1], "PRIMARY_ADDR": ips[0], "MASTER_ADDR": ips[0],
        "NUM_NODES": "2", "NUM_TRAINERS": "8", "WORLD_SIZE": "16", "PRIMARY_PORT": "29500"}
    assert client.get_cluster(cluster["id"])["pods"]["byStatus"] == {"RUNNING": 2}
    assert client.get_cluster(cluster["id"])["dataCenterId"] == "EU-RO-1"

    assert client.list_pods() == []  # members are left out by default
    assert len(client.list_pods(include_cluster_pods=True)) == 2
    with pytest.raises(RunPodError) as info:
        client.delete_pod(pods[0]["id"])
    assert info.value.status == 409

    assert client.delete_cluster(cluster["id"]) is True
    assert {client.get_pod(p["id"])["status"] for p in pods} == {"TERMINATED"}
    with pytest.raises(RunPodNotFound):
        client.get_cluster(cluster["id"])
    assert all(p.popen.poll() is not None for p in standin.runner.pods)


def test_catalog(client):
    assert [d["id"] for d in client.datacenters(global_network=True)] == ["EU-RO-1", "US-KS-2"]
    assert [d["id"] for d in client.datacenters(global_network=False)] == ["CA-MTL-1"]
    dc = client.datacenters(gpu_availability=True)[0]
    assert {g["id"]: g["availability"] for g in dc["gpuAvailability"]}[H100] == "HIGH"
    gpus = {g["id"]: g for g in client.gpu_types()}
    assert gpus[H100]["price"] == {"secure": 2.69, "community": 1.99}
    assert gpus[H100]["maxCount"]["secure"] == 8 and "availability" not in gpus[H100]
    stock = {g["id"]: g for g in client.gpu_types(availability=True, count=2)}
    assert stock[H100]["availability"] == "HIGH"
    assert [d["id"] for d in stock[A40]["dataCenters"]] == ["EU-RO-1", "CA-MTL-1"]
    assert client.gpu_types(availability=True, count=9)[0]["availability"] == "NONE"


# ------------------------------------------------------------------ on testbed hosts (root)


def test_global_networking_pods_reach_each_other_by_internal_name(testbed2):
    tb = testbed2
    runner = TestbedRunner(tb)
    serve = ('mkdir -p /tmp/www && echo "$RUNPOD_POD_ID" > /tmp/www/id && cd /tmp/www && '
             'exec python3 -m http.server --bind "$RUNPOD_POD_ID.runpod.internal" 8000')
    fetch = r"""
set -e
python3 - <<'EOF'
import os, time, urllib.request
url = f"http://{os.environ['HEAD_POD_ID']}.runpod.internal:8000/id"
deadline = time.time() + 60
while True:
    try:
        body = urllib.request.urlopen(url, timeout=2).read().decode().strip()
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.1)
print(f"reached {url}: {body}", flush=True)
EOF
exec sleep infinity
"""
    with RunPodStandIn(runner, api_key=KEY) as api:
        client = RunPodClient(KEY, base_url=api.url)
        head = client.create_pod(pod_body("rt-gn-0", globalNetworking=True,
                                          args=b64_script_args(serve)))
        worker = client.create_pod(pod_body(
            "rt-gn-1", globalNetworking=True, args=b64_script_args(fetch),
            env={"PYTHONUNBUFFERED": "1", "HEAD_POD_ID": head["id"]}))
        assert log_lines(client, worker["id"], "reached", 1) == [
            f"reached http://{head['id']}.runpod.internal:8000/id: {head['id']}"]
        pods = [wait_status(client, p["id"], "RUNNING") for p in (head, worker)]
        hosts = [tb.hosts[api.pod(p["id"]).handle.index] for p in pods]
        assert hosts[0] is not hosts[1]
        for pod, host in zip(pods, hosts):
            assert pod["globalNetworking"] == {"enabled": True, "ip": host.ip,
                                               "internalDns": f"{pod['id']}.runpod.internal"}
        serving = log_lines(client, head["id"], "Serving HTTP", 1)
        assert serving[0].startswith(f"Serving HTTP on {hosts[0].ip} port 8000")  # its own address

        for pod in pods:
            client.pod_action(pod["id"], "terminate")
        assert runner.busy == {} and tb.processes(hosts[0]) == []
        assert {client.get_pod(p["id"])["status"] for p in pods} == {"TERMINATED"}
        assert api.errors == []


def _link_bytes(tb, host, dev):
    out = tbmod._ip("-n", host.netns, "-s", "-j", "link", "show", dev).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


def test_instant_cluster_members_talk_over_ens1(testbed2):
    tb = testbed2
    runner = TestbedRunner(tb)
    script = r"""
set -e
ip -o -4 addr show dev ens1 | awk '{print "ens1 " $4}'
python3 - <<'EOF'
import os, socket, time
rank, addr = int(os.environ["NODE_RANK"]), os.environ["NODE_ADDR"]
primary, port = os.environ["PRIMARY_ADDR"], int(os.environ["PRIMARY_PORT"])
size = 4 << 20
if rank == 0:
    server = socket.create_server((addr, port))
    conn, peer = server.accept()
    got = 0
    while got < size:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    conn.sendall(b"ok")
    print(f"rank0 received {got} bytes from {peer[0]}", flush=True)
else:
    deadline = time.time() + 60
    while True:
        try:
            conn = socket.create_connection((primary, port), timeout=2)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    conn.sendall(b"x" * size)
    print(f"rank1 got {conn.recv(2).decode()} from {primary}", flush=True)
EOF
exec sleep infinity
"""
    with RunPodStandIn(runner, api_key=KEY) as api:
        client = RunPodClient(KEY, base_url=api.url)
        cluster = client.create_cluster({
            "name": "rt-ic", "type": "TRAINING", "image": "runpod/pytorch:latest",
            "compute": {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2},
            "env": {"PYTHONUNBUFFERED": "1"}, "args": b64_script_args(script)})
        pods = client.cluster_pods(cluster["id"])
        ips = [p["cluster"]["ip"] for p in pods]
        lines = [log_lines(client, p["id"], ("ens1", "rank"), 2) for p in pods]
        assert lines[0] == [f"ens1 {ips[0]}/24", f"rank0 received {4 << 20} bytes from {ips[1]}"]
        assert lines[1] == [f"ens1 {ips[1]}/24", f"rank1 got ok from {ips[0]}"]
        hosts = [tb.hosts[api.pod(p["id"]).handle.index] for p in pods]
        rx_ens1, _ = _link_bytes(tb, hosts[0], "ens1")
        rx_eth0, _ = _link_bytes(tb, hosts[0], "eth0")
        assert rx_ens1 >= 4 << 20 > rx_eth0  # the data came over ens1, not eth0
        assert [wait_status(client, p["id"], "RUNNING")["status"] for p in pods] == ["RUNNING"] * 2
        client.delete_cluster(cluster["id"])
        assert runner.busy == {}
        assert api.errors == []


@pytest.mark.parametrize("path, words", [
    ("/catalog/gpus?foo=1", "query.foo: unknown query parameter (this operation takes cloud, count, countryCodes"),
    ("/catalog/gpus?count=0", "query.count: 0 is less than the minimum of 1"),
    ("/catalog/gpus?count=two", "query.count: 'two' is not of type 'integer'"),
    ("/catalog/gpus?cloud=MOON", "query.cloud: 'MOON' is not one of"),
    ("/catalog/gpus?product=POD&product=CLUSTER", "query.product: given 2 times"),
    ("/catalog/gpus?include=AVAILABILITY,AVAILABILITY", "query.include: ['AVAILABILITY', 'AVAILABILITY'] is too long"),
    ("/catalog/datacenters?globalNetwork=yes", "query.globalNetwork: 'yes' is not of type 'boolean'"),
    ("/catalog/datacenters?include=NOPE", "query.include[0]: 'NOPE' is not one of"),
    ("/pods?includeClusterPods=", "query.includeClusterPods: '' is not of type 'boolean'"),
    ("/pods?name=rt-", "query.name: unknown query parameter (this operation takes includeClusterPods)"),
    ("/clusters?verbose=1", "query.verbose: unknown query parameter (this operation takes none)"),
])
def test_query_parameters_are_checked_against_the_operations_parameters(standin, path, words):
    """Issue 32, item 14: every name and value, as RunPod's document declares them; the unknown refused."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(standin.url + path, headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    problem = json.loads(info.value.read())
    assert info.value.code == 422 and any(words in e for e in problem["errors"]), problem


def test_the_clients_own_queries_pass_the_check(standin, client):
    """What the client sends (catalog filters, include, log tail and since) is what the document allows."""
    assert client.datacenters(global_network=True, gpu_availability=True)
    assert client.gpu_types(availability=True, product="CLUSTER", count=2, cloud="SECURE")
    client.list_pods(include_cluster_pods=True)
