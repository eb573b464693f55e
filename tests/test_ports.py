"""Ports picked for a server another process starts later (a local cluster's Ray, a forward's
`ssh -L`) must not be ones the kernel hands out meanwhile: CI once saw a local head's dashboard
port taken by another test's server in the seconds between the pick and Ray's bind."""

import socket

import pytest

from rlhf_tasks.agent.protocol import ports


def test_ports_are_picked_below_the_kernels_ephemeral_range_and_above_rays_worker_ports():
    low, _ = ports.ephemeral_range()
    picked = ports.free_ports(50, host="")
    assert len(set(picked)) == 50
    for port in picked:
        assert ports.PICK_FROM <= port < low, port
        assert not 10002 <= port <= 19999


def test_a_picked_port_can_be_bound_on_every_address():
    port = ports.free_port(host="")
    with socket.socket() as sock:
        sock.bind(("", port))


def test_a_port_in_use_is_never_picked():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        used = taken.getsockname()[1]
        # Only one port left to pick from besides the taken one.
        assert ports.free_ports(1, host="", span=(used, used + 2)) == [used + 1]


def test_without_room_below_the_ephemeral_range_the_kernel_picks():
    port = ports.free_port(host="127.0.0.1", span=(20000, 20000))
    assert port >= ports.ephemeral_range()[0]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_the_range_read_from_the_kernel():
    low, high = ports.ephemeral_range()
    assert 1024 <= low <= high <= 65535


def test_a_local_clusters_ray_ports_are_never_ones_the_kernel_hands_out(rlhf_home):
    from rlhf_tasks import providers
    from rlhf_tasks.spec import load_task
    from conftest import ROOT

    low, _ = ports.ephemeral_range()
    for _ in range(20):
        plan = providers.get("local").plan(load_task(ROOT / "tasks" / "tiny-grpo.yaml"))
        picked = [plan.ray.port, plan.ray.dashboard_port, plan.ray.client_server_port, plan.ray.ready_port]
        assert len(set(picked)) == 4
        assert all(ports.PICK_FROM <= port < low for port in picked), picked


def test_each_local_cluster_has_its_own_autoscaler_metrics_port(rlhf_home):
    """Every local cluster's head runs Ray's autoscaler monitor, whose metrics server binds one fixed port
    (AUTOSCALER_METRIC_PORT, 44217: ray/autoscaler/_private/constants.py): two local clusters at once collided
    there, and the second head's monitor.log held a traceback that the failure summary named as the node's first
    error (the full run's test_an_error_raised_on_another_node... failure). Each plan picks its own; the task's
    own value wins."""
    from rlhf_tasks import providers
    from rlhf_tasks.spec import load_task
    from conftest import ROOT

    task = load_task(ROOT / "tasks" / "tiny-grpo.yaml")
    first, second = (providers.get("local").plan(task) for _ in range(2))
    picked = [int(p.env["AUTOSCALER_METRIC_PORT"]) for p in (first, second)]
    assert picked[0] != picked[1] and 44217 not in picked, picked
    assert all(ports.PICK_FROM <= port < ports.ephemeral_range()[0] for port in picked), picked
    own = task.model_copy(update={"env": {**task.env, "AUTOSCALER_METRIC_PORT": "45000"}})
    assert providers.get("local").plan(own).env["AUTOSCALER_METRIC_PORT"] == "45000"


def test_ports_to_avoid_are_never_picked():
    assert ports.free_ports(1, host="", span=(ports.PICK_FROM, ports.PICK_FROM + 2), avoid=[ports.PICK_FROM]) == \
        [ports.PICK_FROM + 1]


def test_a_local_clusters_ray_ports_avoid_the_ports_its_services_are_ready_on(rlhf_home, monkeypatch):
    """tiny-grpo's reward server listens on 23080, inside the range Ray's ports are picked from; Ray's GCS
    listens on every address, so its port must not be that one."""
    from rlhf_tasks import providers
    from rlhf_tasks.providers import local
    from rlhf_tasks.spec import load_task
    from conftest import ROOT

    asked = []
    monkeypatch.setattr(local, "free_ports", lambda *a, **kw: asked.append(kw) or ports.free_ports(*a, **kw))
    providers.get("local").plan(load_task(ROOT / "tasks" / "tiny-grpo.yaml"))
    assert asked and set(asked[0]["avoid"]) == {23080}


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound():
    """An API server's port picked, then its etcd's two: none of them may be the same, though the first is not
    bound yet when the others are picked."""
    span = (ports.PICK_FROM + 100, ports.PICK_FROM + 120)
    picked = [ports.free_port(host="", span=span) for _ in range(20)]
    assert len(set(picked)) == 20, picked


def test_seeding_random_does_not_make_two_processes_pick_alike():
    import random

    random.seed(7)
    first = ports.free_ports(5, host="")
    random.seed(7)
    assert ports.free_ports(5, host="") != first


def test_the_picker_travels_to_a_ray_actor_by_value():
    """The preflight probe, a Ray actor, picks its all_reduce port on its node; Ray pickles the agent's modules
    by value there, globals and all (CI: "NotImplementedError: System entropy source does not have state")."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    cloudpickle.register_pickle_by_value(ports)
    try:
        again = cloudpickle.loads(cloudpickle.dumps(ports.free_port))
    finally:
        cloudpickle.unregister_pickle_by_value(ports)
    assert ports.PICK_FROM <= again(host="") < ports.ephemeral_range()[0]
