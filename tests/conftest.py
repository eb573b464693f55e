"""Shared fixtures, and the two test tiers.

Tests that need root or a package run in CI (CI=true, any case) and fail there when it is
missing; locally they skip with the reason. In CI every skip fails, whoever skips.

The `cluster` mark: the test starts a Ray cluster, network-namespace hosts, Slurm or a
container. `make test-fast` runs the others (`-m "not cluster"`), `make test` all. A test
gets the mark from a fixture declared with :func:`starts_cluster` (the testbed and Slurm
fixtures, `cli_env`), or by hand. The tier stays honest: what starts a cluster in the test
process (a `Testbed`, Ray's own daemons, Slurm, a container, a namespace) fails a test
without the mark (:func:`require_cluster_mark`). A `launch` on this machine runs in a
subprocess the guard cannot see into: give such a test `cli_env`, as the local ones do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

import testbed as tbmod

ROOT = Path(__file__).resolve().parent.parent
IN_CI = tbmod.in_ci()
CLUSTER = "cluster"
#: What a test must carry the `cluster` mark to start (the basename of a subprocess's program): Ray's
#: CLI (`ray start`) and daemons, Slurm's, a container engine, a namespace, Kubernetes' programs.
CLUSTER_PROGRAMS = frozenset({"ray", "gcs_server", "raylet", "slurmctld", "slurmd", "sbatch", "srun", "salloc",
                              "munged", "podman", "docker", "nsenter", "unshare", "etcd", "kube-apiserver",
                              "kube-controller-manager", "kube-scheduler", "kube-streams"})

_running: list[pytest.Item] = []  # the test being run, if any
_stand_ins: set[str] = set()  # programs the running test made itself, under a guarded name (stand_in)


def need(condition: bool, reason: str) -> None:
    """Skip locally, fail in CI: CI must never skip silently."""
    if not condition:
        if IN_CI:
            pytest.fail(f"required in CI: {reason}")
        pytest.skip(reason)


def starts_cluster(fixture_function):
    """Declare that a fixture starts a cluster: every test using it, directly or through
    another fixture, gets the `cluster` mark (put it under ``@pytest.fixture``)."""
    fixture_function.starts_cluster = True
    return fixture_function


def require_cluster_mark(what: str) -> None:
    """Fail the running test unless it has the `cluster` mark: `make test-fast` must not start `what`."""
    item = _running[-1] if _running else None
    if item is not None and item.get_closest_marker(CLUSTER) is None:
        pytest.fail(f"{item.nodeid} starts {what} but has no `cluster` mark, so `make test-fast` would run it: "
                    "use a fixture declared with conftest.starts_cluster, or mark the test @pytest.mark.cluster",
                    pytrace=False)


def stand_in(path) -> None:
    """Declare a program the running test wrote itself under a guarded name (a `ray` that only
    records its argv): starting it starts no cluster. Only this file, for this test."""
    _stand_ins.add(os.path.realpath(path))


def _audit(event: str, args: tuple) -> None:
    """Ray's daemons, Slurm, a container engine or a namespace started from the test process."""
    if event != "subprocess.Popen" or not _running:
        return
    argv = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    argv = [os.fsdecode(a) if isinstance(a, (str, bytes, os.PathLike)) else str(a) for a in argv]
    given = os.fsdecode(args[0]) if args[0] else (argv[0] if argv else "")
    program = os.path.basename(given)
    if program in CLUSTER_PROGRAMS or argv[:3] == ["ip", "netns", "add"]:
        if _stand_ins:
            import shutil

            env = args[3] if len(args) > 3 and isinstance(args[3], dict) else os.environ
            found = shutil.which(given, path=env.get("PATH", os.defpath)) if os.sep not in given else given
            if found and os.path.realpath(found) in _stand_ins:
                return
        require_cluster_mark(f"`{' '.join(argv[:3])}`")


def pytest_configure(config):
    # Tests send Ctrl-C (SIGINT) to the launchers they start. A shell without job control starts what it runs in
    # the background (`make test &`) with SIGINT ignored, and an ignored signal stays ignored across exec: every
    # launcher would ignore its Ctrl-C. Caught here, it is the default again in every child.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not any(line.startswith(f"{CLUSTER}:") for line in config.getini("markers")):  # pyproject.toml has it
        config.addinivalue_line("markers", f"{CLUSTER}: starts a Ray cluster, namespace hosts, Slurm or a container")
    tbmod.before_start = require_cluster_mark
    if not getattr(sys, "_rlhf_tasks_audit", False):  # audit hooks cannot be removed: add it once
        sys.addaudithook(_audit)
        sys._rlhf_tasks_audit = True


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info else ()
        if any(getattr(d.func, "starts_cluster", False) for chain in defs for d in chain):
            item.add_marker(CLUSTER)
        group = xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # a worker of `make test`'s (pytest-xdist): the longest first
        items.sort(key=run_order)


#: The fixtures whose programs `make test` builds in the background (tests/kube/build.sh): their tests
#: are one group, which one worker runs first while the other runs the rest (and the build, at nice 19,
#: takes what CPU the tests leave).
KUBE_BUILD_FIXTURES = frozenset({"kube_cluster", "real_kubectl"})


def _our_fixtures(item):
    """The fixtures of the item's closure that the test suite defines (not pytest's or a plugin's)."""
    info = getattr(item, "_fixtureinfo", None)
    root = str(item.config.rootpath)
    for name, chain in (info.name2fixturedefs.items() if info else ()):
        for d in chain:
            code = getattr(d.func, "__code__", None)
            if code and code.co_filename.startswith(root) and not code.co_filename.startswith(sys.prefix):
                yield name, d


def xdist_group(item) -> str | None:
    """What `make test`'s workers (pytest-xdist, `--dist loadgroup`) must not split: the tests of a
    fixture wider than one test (a module's testbed, the session's Kubernetes cluster) run in one
    worker, so that it starts once. Other tests go one by one to whichever worker is free."""
    scoped = [(name, d.scope) for name, d in _our_fixtures(item) if d.scope in ("module", "package", "session")]
    if any(name in KUBE_BUILD_FIXTURES for name, _ in scoped):
        return "kube"
    if any(scope == "session" for _, scope in scoped):
        return "session-" + "-".join(sorted(name for name, scope in scoped if scope == "session"))
    if scoped:
        return item.nodeid.split("::")[0]
    return None


def run_order(item) -> int:
    """The longest first, so that the workers end together: the Kubernetes tests (on a cold
    cache they wait for their build while the other workers go on), then the other session-wide
    groups (the dstack server's), then the other cluster tests, then the fast tier (short tests that
    even out the workers' ends), and last a test marked `alone`: by then the other workers are in the
    fast tier, which takes no lock, so none idles while it runs (in the middle of the run the other
    worker waited on the lock for as long as it ran). Python's sort is stable: each keeps the
    collection's order."""
    group = xdist_group(item) or ""
    if group == "kube":
        return 0
    if group.startswith("session-") or (group and item.get_closest_marker("waits") is not None):
        return 1
    if item.get_closest_marker("alone") is not None and not group:
        return 4
    return 2 if item.get_closest_marker(CLUSTER) else 3


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the test
def pytest_runtest_teardown(item, nextitem):
    """In `make test`'s workers a session-wide cluster (the Kubernetes control plane and operator, the dstack
    server) ends after its group's last test, not at the session's end: left running, its polling took CPU
    from every test after it. A group's tests run one after another in one worker (`xdist_group`, `run_order`);
    a plain `pytest` run keeps them to the end, its order being the files'."""
    if nextitem is None or not hasattr(item.config, "workerinput"):
        return
    group = xdist_group(item)
    if not group or not (group == "kube" or group.startswith("session-")) or xdist_group(nextitem) == group:
        return
    for name, fixturedef in _our_fixtures(item):
        if fixturedef.scope == "session" and getattr(fixturedef.func, "starts_cluster", False) \
                and fixturedef.cached_result is not None:
            fixturedef.finish(item._request)  # what depends on it (the dstack fleet) is finished first


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skip is a failure, whoever skips (`pytest.importorskip`, a fixture, a helper):
    CI must run every test it collects."""
    report = yield
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where nothing may skip: {reason}"
    return report


#: Where each test's start and end go, one line each (`RLHF_TASKS_TIMELINE=FILE make test`): which
#: worker ran what when, and the CPU it cost with all it started (tests/cpuacct.py), for fitting the suite
#: in its time (docs/development.md, tests/timeline.py).
TIMELINE = os.environ.get("RLHF_TASKS_TIMELINE")
_account = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    global _account
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if TIMELINE and _account is None:
        import cpuacct

        _account = cpuacct.Account(f"rlhf-tasks-tests-{os.getpid()}-{worker}")
    _running.append(item)
    began, cpu = time.time(), _account.seconds() if _account else None
    try:
        return (yield)
    finally:
        _running.pop()
        _stand_ins.clear()
        if TIMELINE:
            used = "" if cpu is None else f"{_account.seconds() - cpu:.1f}"
            left = "" if cpu is None else str(_account.processes())
            with open(TIMELINE, "a") as out:
                out.write(f"{worker}\t{began:.1f}\t{time.time():.1f}\t{item.nodeid}\t{used}\t{left}\n")


def pytest_unconfigure(config):
    if _account is not None:
        _account.close()


#: Cluster tests that run at once, however many workers `make test` has: what they do at once (Ray on every host,
#: its daemons, the servers) fills 2 cores. A test marked `waits` takes no slot: most of its time is a server's fixed
#: intervals (dstack's), so a third worker runs it beside two others.
CLUSTER_SLOTS = 2


@pytest.fixture(autouse=True)
def _side_by_side(request, tmp_path_factory):
    """`make test`'s workers run cluster tests side by side, sharing 2 cores: at most `CLUSTER_SLOTS` at once,
    and beside them those marked `waits`. A test marked `alone` (it bounds how fast something happens, e.g. a
    silent node declared dead within 18 s) runs with no other cluster test beside it: it takes the workers'
    lock exclusively, every other cluster test shares it. The fast tier takes no lock."""
    item = request.node
    if item.get_closest_marker(CLUSTER) is None or not hasattr(request.config, "workerinput"):
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    # every worker's basetemp is popen-gwN in the run's own directory
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "cluster-tests.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone or item.get_closest_marker("waits") is not None:
            yield
            return
        with _cluster_slot(shared):
            yield


@contextlib.contextmanager
def _cluster_slot(shared: Path):
    """One of the `CLUSTER_SLOTS` lock files, held while the test runs; polled, since one flock cannot wait for
    whichever of several is free first."""
    slots = [open(shared / f"cluster-slot-{i}.lock", "a") for i in range(CLUSTER_SLOTS)]
    try:
        while not any(_try_lock(f) for f in slots):
            time.sleep(0.2)
        yield
    finally:
        for f in slots:
            f.close()


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@pytest.fixture
def rlhf_home(tmp_path, monkeypatch):
    """A private launcher state dir (tokens, cluster records) for one test."""
    home = tmp_path / "home"
    monkeypatch.setenv("RLHF_TASKS_HOME", str(home))
    return home


@pytest.fixture
@starts_cluster
def cli_env(rlhf_home):
    """Environment for running the CLI as a subprocess, as a user would: `launch` on this
    machine starts a local cluster, so a test using it is a `cluster` test."""
    env = dict(os.environ, RLHF_TASKS_HOME=str(rlhf_home), PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


@pytest.fixture(scope="session")
@starts_cluster
def kube_cluster(tmp_path_factory):
    """The session's Kubernetes cluster (tests/kube/): a real control plane and KubeRay
    operator, pods on namespace hosts. Built by `make kube` (tests/kube/build.sh) first."""
    need(shutil.which("go") is not None, "the Kubernetes tests build Kubernetes and KubeRay with Go (not on PATH)")
    reason = tbmod.require_root()
    need(reason is None, reason or "")
    from kube.cluster import KubeCluster
    cluster = KubeCluster(tmp_path_factory.mktemp("kube"), shared=[tmp_path_factory.getbasetemp()])
    yield cluster
    cluster.close()


@pytest.fixture
def ns(kube_cluster, request):
    """A namespace of the test's own on the session's Kubernetes cluster, deleted after it (pass or
    fail), so its pods free their hosts."""
    name = kube_cluster.namespace(request.node.name[5:30])
    yield name
    kube_cluster.cp.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
@starts_cluster
def dstack_bed(tmp_path_factory):
    """The session's real dstack server and CLI on a testbed's laptop, and two namespace hosts ready to be
    an SSH fleet (tests/dstack/README.md), for both dstack files: one worker runs them one after another
    (a bed of their own each, side by side, overloaded the 2 cores: Ray's nodes timed out starting). dstack[server]
    is installed into a cached virtualenv first."""
    reason = tbmod.require_root()
    need(reason is None, reason or "")
    import importlib.util
    spec = importlib.util.spec_from_file_location("dstack_bed_server", ROOT / "tests" / "dstack" / "server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    bed = module.DstackBed(2, tmp_path_factory.mktemp("dstack"), shared=[tmp_path_factory.getbasetemp()])
    yield bed
    bed.close()
