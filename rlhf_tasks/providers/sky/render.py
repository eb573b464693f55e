"""The SkyPilot task YAML (`render`, pure) and what must hold before it is written: our Ray's ports clear of
SkyPilot's own Ray, the shared storage, the GPUs in SkyPilot's words, and SkyPilot's own code's word on the
render where SkyPilot is installed here (its task schema, Task.from_yaml_config, its catalog).

SkyRender is the provider without its side effects; SkyProvider (the package) adds `launch`, `status`,
`down` and `forward`, which drive the `sky` CLI.
"""

from __future__ import annotations

import math
import os
import re
import shlex

from ... import workdir
from ...errors import BadInput
from ...models import size_bytes
from ...plan import Contract, Plan, env
from ...spec import Task
from ..base import AMD_CONTAINER_OPTIONS, Option, Provider, Retries, docker_size
from ..shipping import LOCAL_DIR, NODE_DIR, agent_command, dump_yaml, shared_entry, shipped_files
from .catalog import OWN_NAMES, catalog_accelerators, catalog_memory, devices_by_memory
from .resources import KUBERNETES_CLOUDS, SKY_DEFAULT_DISK, disk_size, sky_gpu, sky_gpu_refusal, sky_memory
from .storage import SHARING, VOLUME_CLOUDS, SkyShared

#: Ports SkyPilot's own Ray uses on every node (sky/provision/instance_setup.py, and `ray start`'s
#: defaults for what it leaves out): ours must never collide.
RESERVED_PORTS = {6380: "SkyPilot's Ray GCS", 8266: "SkyPilot's Ray dashboard", 52365: "SkyPilot's dashboard agent",
                  8076: "SkyPilot's Ray object manager", 10001: "SkyPilot's Ray client server"}
#: SkyPilot's Ray workers: 11002-19999 on its head, Ray's default 10002-19999 on the other nodes.
SKYPILOT_WORKER_PORTS = (10002, 19999)
#: Our dashboard agent must not take SkyPilot's 52365.
AGENT_LISTEN_PORT = 52366
#: Ray's own layout moved up by 10000: our client server (unless the task names one) and our workers.
CLIENT_SERVER_PORT = 20001
WORKER_PORTS = (20002, 22999)
#: What SkyPilot's command runner exports before its `ray start`, which its job hands to the task.
LEAKED_ENV = ("OMP_NUM_THREADS", "PYTHONWARNINGS")
#: Where SkyPilot syncs the task's `workdir` on every node, and where its run script starts `run`.
SKY_WORKDIR = "~/sky_workdir"


class SkyRender(Provider):
    """The provider's pure part: its contract and ports, the task's checks in SkyPilot's terms (its own code
    asked where it is installed), the plan and the rendered task YAML."""

    name = "sky"
    shared_option = "checkpoints.shared.sky: {bucket: s3://BUCKET/PATH} or {volume: NAME}"
    sharing = SHARING
    contract = Contract(
        rank=env("SKYPILOT_NODE_RANK"),
        nodes=env("SKYPILOT_NUM_NODES"),
        head=env("SKYPILOT_NODE_IPS", item=0),
        node_addr=env("SKYPILOT_NODE_IPS", item="rank"),
        cluster_id=env("SKYPILOT_TASK_ID"),
        gpus_per_node=env("SKYPILOT_NUM_GPUS_PER_NODE"),
    )
    ray_overrides = {"agent_listen_port": AGENT_LISTEN_PORT, "min_worker_port": WORKER_PORTS[0],
                     "max_worker_port": WORKER_PORTS[1]}
    options = (Option("--managed", "run as a SkyPilot managed job (recovered on preemption)"),)
    price_bound = "SkyPilot's resources.max_hourly_cost"
    ignores = {"fleets": "SkyPilot has no fleets; placement.backends and regions choose its clouds"}

    #: Read in SkyPilot 0.14.1 (sky/dag.py, sky/utils/dag_utils.py, sky/jobs/controller.py).
    groups_refusal = (
        "SkyPilot 0.14.1 gives every node of a task one resources block; its JobGroups (a multi-document YAML with "
        "execution: parallel, sky jobs launch only) make each group a cluster of its own, which the jobs controller "
        "launches and recovers alone (sky/jobs/controller.py _monitor_job_group_task), so one Ray cluster over them "
        "would lose its head whenever the head's group alone were recovered")

    def check(self, task: Task) -> None:
        for field in ("port", "dashboard_port", "client_server_port", "ready_port"):
            if field == "client_server_port" and field not in task.ray.model_fields_set:
                continue  # moved to CLIENT_SERVER_PORT by build()
            port = getattr(task.ray, field)
            if port in RESERVED_PORTS:
                raise BadInput(f"ray.{field}: {port} is used by {RESERVED_PORTS[port]} on every SkyPilot node; "
                               f"choose another")
            for (low, high), whose in ((SKYPILOT_WORKER_PORTS, "SkyPilot's Ray workers"),
                                       ((CLIENT_SERVER_PORT, WORKER_PORTS[1]), "our Ray's client server and workers")):
                if low <= port <= high:
                    raise BadInput(f"ray.{field}: {port} is inside {low}-{high}, the ports of {whose} on a "
                                   f"SkyPilot node; choose another")
        shared = shared_entry(SkyShared, task.checkpoints.shared.get(self.name), self.name)
        outside = [b for b in task.placement.backends if b.lower() not in VOLUME_CLOUDS]
        if shared and shared.volume and outside:
            raise BadInput(f"checkpoints.shared.sky.volume: {shared.volume}: SkyPilot volumes are on "
                           f"{' or '.join(VOLUME_CLOUDS)} only, and a volume pins the task to its cloud, but "
                           f"placement.backends lists {', '.join(outside)} (`sky launch` would refuse the task: "
                           f"VolumeTopologyConflictError); use checkpoints.shared.sky: {{bucket: s3://BUCKET/PATH}}, "
                           f"which every cloud's nodes mount, or leave {', '.join(outside)} out")
        refusal = sky_gpu_refusal(task.resources.gpus)
        if refusal:
            raise BadInput(f"resources.gpus: {task.resources.gpus}: {refusal}")
        if self.chosen["managed"] and task.job.submit != "head":
            raise BadInput("--managed: a managed job must submit from the head (job.submit: head), "
                           "since SkyPilot relaunches the whole task on recovery")

    def build(self, task: Task) -> Plan:
        plan = super().build(task)
        if "client_server_port" not in task.ray.model_fields_set:  # 10001 is SkyPilot's Ray's
            plan = plan.replace(ray=plan.ray.model_copy(update={"client_server_port": CLIENT_SERVER_PORT}))
        return plan

    def cache_dir(self, plan: Plan) -> str | None:
        """On a SkyPilot volume, as elsewhere; not on a bucket: MOUNT_CACHED is rclone's `--vfs-cache-mode full`
        (sky/data/mounting_utils.py, get_mount_cached_cmd), which uploads from each node's own cache in the
        background, so a model the head fetched is not yet there for the others, and MOUNT (goofys) makes no
        symlinks, which the hub's cache is made of: each node keeps its own cache."""
        shared = shared_entry(SkyShared, plan.checkpoint_shared, self.name)
        return None if shared and shared.bucket else super().cache_dir(plan)

    def retries(self, plan: Plan) -> Retries | None:
        """A managed job (`--managed`) is recovered by SkyPilot's jobs controller (sky/jobs/controller.py,
        _run_one_task): a cluster found not UP (preempted, failed) is relaunched with no count, whatever
        job_recovery says; a job that failed on an UP cluster (its user code: FAILED, FAILED_SETUP,
        FAILED_DRIVER) is restarted only while recovery_strategy.py should_restart_on_failure allows
        (max_restarts_on_errors, 0 by default); a SUCCEEDED job (exit 0) ends it. `sky launch` relaunches
        nothing."""
        if not self.chosen.get("managed"):
            return None
        errors = plan.placement.retry_errors
        return Retries(on="a preemption" + (f", and after the job's own failure at most {errors} times "
                                             f"(max_restarts_on_errors)" if errors else ""),
                       unbounded="a preempted cluster is recovered with no count: max_restarts_on_errors counts "
                                 "only the job's own failures",
                       cites="SkyPilot's sky/jobs/controller.py and recovery_strategy.py should_restart_on_failure",
                       on_failure=bool(errors), cap_exit=0)

    def notes(self, plan: Plan) -> list[str]:
        """`check` and `render` do not know whether `launch --managed` will run it: what that would refuse;
        whether a volume is of a type every node shares, which only `sky volumes ls` knows; and what SkyPilot
        does to the sizes (size_notes)."""
        out = super().notes(plan)
        if not self.chosen.get("managed"):
            try:
                type(self)(managed=True).retry_rules(plan)
            except BadInput as exc:
                out.append(f"with `launch --managed`: {exc} (`launch --managed` refuses it)")
        shared = shared_entry(SkyShared, plan.checkpoint_shared, self.name)
        if shared and shared.volume and plan.nodes > 1:
            out.append(f"checkpoints.shared.sky.volume {shared.volume}: every node shares it only if it is a RunPod "
                       f"network volume, a ReadWriteMany k8s-pvc (`sky launch` refuses a ReadWriteOnce one for "
                       f"{plan.nodes} nodes) or a k8s-hostpath that is one network filesystem on every Kubernetes "
                       f"node (else each node's own directory): `check` cannot see its type (`sky volumes ls`)")
        return out + self.size_notes(plan)

    def uploads_working_dir(self, plan: Plan) -> bool:
        """`submit: head` too: `sky launch` rsyncs job.working_dir to every node and the head's Ray uploads
        that copy to the job, so what it packs is measured here, before anything is rented."""
        return super().uploads_working_dir(plan) or (bool(plan.job.working_dir) and plan.job.submit == "head")

    def upload_excluded(self, plan: Plan) -> list:
        """What SkyPilot's rsync leaves out: with a .skyignore at the top, what every .skyignore names
        (it then reads no .gitignore; the head's Ray still does); else .gitignore, which Ray reads too
        (sky/utils/command_runner.py SSHCommandRunner.rsync, RSYNC_FILTER_SKYIGNORE / _GITIGNORE)."""
        if plan.job.submit != "head" or not os.path.isfile(os.path.join(plan.job.working_dir, ".skyignore")):
            return []
        return [workdir.ignore_files(plan.job.working_dir, ".skyignore")]

    def upload_words(self, plan: Plan) -> str:
        if plan.job.submit != "head":
            return super().upload_words(plan)
        return (f"`sky launch` syncs it to {SKY_WORKDIR} on every node (SkyPilot's workdir; what .skyignore, else "
                f".gitignore, names is left out), and the head uploads it from there to the job (Ray's "
                f"working_dir, leaving out job.excludes)")

    def workdir(self, plan: Plan) -> str | None:
        """SkyPilot's `workdir`: job.working_dir as seen from where `sky launch` runs (the rendered
        files' directory: render_dir, or the current directory, where render writes them)."""
        if not plan.job.working_dir or plan.job.submit != "head":
            return None
        here = os.path.abspath(self.render_dir or ".")
        return os.path.relpath(os.path.abspath(os.path.expanduser(plan.job.working_dir)), here)

    @staticmethod
    def node_plan(plan: Plan) -> Plan:
        """The plan the nodes read: with a workdir, the job's working_dir is SkyPilot's copy of it,
        the directory `run` starts in."""
        if not plan.job.working_dir or plan.job.submit != "head":
            return plan
        return plan.replace(job=plan.job.model_copy(update={"working_dir": "."}))

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """A line for `check` and `render` when a multi-node run resumes from per-node directories."""
        if plan.nodes < 2 or not plan.unshared_checkpoints:
            return None
        return (f"checkpoints {plan.checkpoint_dir} is a directory on each SkyPilot node: the "
                f"{plan.nodes} nodes do not share it, and a relaunched cluster starts without it; add "
                f"checkpoints.shared.sky: {{bucket: s3://BUCKET/PATH}} or {{volume: NAME}}")

    @staticmethod
    def size_notes(plan: Plan) -> list[str]:
        """What SkyPilot does to the task's sizes that its render cannot show: a disk rounded up to its whole GB,
        and where the task can land on Kubernetes, the shm size dropped and the disk made an ephemeral-storage
        request (sky/clouds/kubernetes.py, Kubernetes.make_deploy_resources_variables)."""
        res, out = plan.resources, []
        backends = [b.lower() for b in plan.placement.backends]
        kube = any(b in KUBERNETES_CLOUDS for b in backends) or not backends
        who = "on Kubernetes SkyPilot" if backends else \
            "if SkyPilot places the task on Kubernetes (placement.backends does not rule it out), it"
        disk = disk_size(res.disk) if res.disk else None
        if disk is not None and disk * 2**30 != size_bytes(res.disk):
            out.append(f"resources.disk {res.disk}: SkyPilot's disk_size is a whole number of its GB (2^30 bytes), so "
                       f"it asks {disk} ({disk * 2**30 / 10**9:.1f}GB), rounded up")
        if kube and res.shm_size:
            shm = f"--shm-size={docker_size(res.shm_size)} does not reach the pod" if plan.image else \
                "nothing sizes it"
            out.append(f"resources.shm_size {res.shm_size}: {who} ignores docker.run_options, so {shm}: "
                       f"its pod's /dev/shm is a memory emptyDir with no size limit, bounded by the pod's memory "
                       f"(sky/resources.py Resources.make_deploy_variables; templates/kubernetes-ray.yml.j2, dshm)")
        if kube and disk == SKY_DEFAULT_DISK:
            out.append(f"resources.disk {res.disk}: {who} requests no ephemeral storage for disk_size "
                       f"{disk}, its default, which it reads as none given (Resources._from_yaml_config_single)")
        elif kube and disk is not None:
            less = f", less than the {res.disk} asked" if disk * 10**9 < size_bytes(res.disk) else ""
            out.append(f"resources.disk {res.disk}: {who} makes disk_size {disk} each pod's "
                       f"ephemeral-storage request, {disk}G ({disk}GB: Kubernetes' G is 10^9 bytes{less}), and a "
                       f"pod whose node has less allocatable ephemeral storage is not scheduled (a node's is its "
                       f"kubelet's disk, often far less than a VM's: `kubectl describe node`); SkyPilot offers only "
                       f"contexts whose nodes fit it (kubernetes_utils.check_instance_fits). Leave resources.disk out "
                       f"for Kubernetes, or set placement.backends to the clouds you mean")
        return out

    def autostop(self, plan: Plan) -> dict | None:
        """SkyPilot's own autostop, run by the cluster (its skylet on the head), so that the VMs end
        once the run is over with no launcher attached: a minute after the task's job ends, or for a
        kept cluster (`launch --keep`) after placement.idle (`never`: none). A managed job's cluster
        is SkyPilot's to end already."""
        if self.chosen.get("managed"):
            return None
        if plan.keep_cluster and plan.budget.idle_s is None:
            return None
        minutes = max(1, -(-int(plan.budget.idle_s) // 60)) if plan.keep_cluster else 1
        return {"idle_minutes": minutes, "down": True}

    def task_config(self, plan: Plan) -> dict:
        res, placement = plan.resources, plan.placement
        resources: dict = {}
        if res.gpus:
            resources["accelerators"] = sky_gpu(res.gpus)
        if res.cpus:  # at least, unless resources.exact says exactly
            resources["cpus"] = f"{res.cpus}" + ("" if res.is_exact("cpus") else "+")
        if res.memory:
            resources["memory"] = sky_memory(res.memory) + ("" if res.is_exact("memory") else "+")
        if res.disk:
            resources["disk_size"] = disk_size(res.disk)
        if plan.image:
            resources["image_id"] = f"docker:{plan.image}"
        if placement.spot != "off":
            resources["use_spot"] = True
        if plan.node_price_bound:  # "the maximum hourly cost (in USD) for instances" (sky/resources.py Resources)
            resources["max_hourly_cost"] = math.ceil(plan.node_price_bound * 10000) / 10000
        if placement.retry:  # the job's own failure only when asked (placement.retry.errors)
            resources["job_recovery"] = {"strategy": "EAGER_NEXT_REGION",
                                         "max_restarts_on_errors": placement.retry_errors}
        if plan.ray.dashboard_host != "127.0.0.1":
            resources["ports"] = [plan.ray.dashboard_port]
        if placement.backends:
            resources["any_of"] = [{"cloud": cloud} for cloud in placement.backends]
        if len(placement.regions) == 1:
            resources["region"] = placement.regions[0]
        autostop = self.autostop(plan)
        if autostop:
            resources["autostop"] = autostop
        config: dict = {"name": plan.name, "num_nodes": plan.nodes, "resources": resources}
        if plan.env:
            config["envs"] = dict(plan.env)
        secrets = list(plan.secrets) + ([plan.token_env] if plan.token_env else [])
        if secrets:
            config["secrets"] = {name: None for name in secrets}
        workdir = self.workdir(plan)
        if workdir:
            config["workdir"] = workdir
        config["file_mounts"] = {NODE_DIR: LOCAL_DIR}
        setup = ["set -e"] + list(plan.setup)
        shared = shared_entry(SkyShared, plan.checkpoint_shared, self.name)
        if plan.checkpoint_dir and shared and shared.bucket:
            config["file_mounts"][plan.checkpoint_dir] = {"source": shared.bucket, "mode": shared.mode}
        elif plan.checkpoint_dir and shared:
            config["volumes"] = {plan.checkpoint_dir: shared.volume}
        elif plan.checkpoint_dir:  # SkyPilot's VMs run as a user that needs sudo outside its home
            ckpt = shlex.quote(plan.checkpoint_dir)
            setup.append(f"mkdir -p {ckpt} 2>/dev/null || "
                         f"{{ sudo mkdir -p {ckpt} && sudo chown \"$(id -u):$(id -g)\" {ckpt}; }}")
        # SkyPilot's own --shm-size guess is skipped when one is given; its docker run gives a container NVIDIA's
        # GPUs only (sky/provision/docker_utils.py, DockerInitializer._configure_runtime): AMD's are ours to pass
        run_options = ([f"--shm-size={docker_size(res.shm_size)}"] if res.shm_size else []) + (
            list(AMD_CONTAINER_OPTIONS) if plan.gpu_vendor == "amd" else [])
        if run_options and plan.image:
            config["config"] = {"docker": {"run_options": run_options}}
        config["setup"] = "\n".join(setup) + "\n"
        leaked = [f"export {k}={shlex.quote(plan.env[k])}" if k in plan.env else f"unset {k}" for k in LEAKED_ENV]
        config["run"] = (f"# SkyPilot's runner exports {' '.join(LEAKED_ENV)} for its own Ray, and its job passes them "
                         f"on: the task's, or Ray's defaults\n" + "; ".join(leaked) + "\n" + agent_command(plan) + "\n")
        return config

    def ask_own_code(self, plan: Plan) -> list[str]:
        """The render as SkyPilot's own code takes it, where SkyPilot is installed here, offline: its task
        schema and `Task.from_yaml_config` (what `sky launch` parses: cloud names included), then the
        accelerator name against SkyPilot's catalog where that is on this machine (SkyPilot's
        canonicalize_accelerator_name, sky/utils/accelerator_registry.py: a name the catalog lacks is kept
        as written, and no cloud's offer carries it)."""
        import copy

        try:
            import sky
            from sky.utils import common_utils, schemas
        except ImportError:
            return ["SkyPilot's task schema, cloud names and accelerator catalog: not checked: skypilot is not "
                    "installed here (pip install 'rlhf-tasks[sky]')"]
        import yaml

        from ...models import did_you_mean

        name = f"{plan.name}.sky.yaml"
        config = yaml.safe_load(self.render(plan)[name])
        gpus = plan.resources.gpus
        by_memory = None
        if gpus and plan.resources.gpu_memory and not plan.resources.gpu_name:
            # SkyPilot's own parse of `80GB:8` reads common/metadata.csv, fetching it where it is not here:
            # it parses the names that file gives instead, or none where it is not on this machine
            by_memory = devices_by_memory(gpus)
            if by_memory == []:
                raise BadInput(f"resources.gpus: {gpus}: no GPU of SkyPilot's catalog (common/metadata.csv) has "
                               f"{sky_gpu(gpus).partition(':')[0]} of memory, so SkyPilot would launch no GPU "
                               f"(Resources._parse_accelerators_from_str, get_devices_by_memory)")
            accelerators = {device: plan.gpus_per_node for device in by_memory or []}
            config["resources"]["accelerators"] = accelerators
            if not accelerators:
                del config["resources"]["accelerators"]
        try:
            common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
            sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes the dict
        except Exception as exc:  # SkyPilot raises ValueError and its own errors, each with its words
            words = str(exc).strip()
            found = re.search(r"any_of\[(\d+)\]\.cloud", words)
            field = f"placement.backends[{found.group(1)}]" if found else \
                "resources.gpus" if "ccelerator" in words else "the task"
            hint = ""
            if found:
                from sky.utils import registry

                wrong = plan.placement.backends[int(found.group(1))]
                hint = "\n  " + did_you_mean(wrong, sorted(registry.CLOUD_REGISTRY), "its clouds")
            raise BadInput(f"{field}: SkyPilot {sky.__version__} refuses {name}: {words}{hint}") from None
        asked = f"SkyPilot {sky.__version__}'s task schema and Task.from_yaml_config take {name}"
        if by_memory is not None:
            return [asked, f"resources.gpus {gpus}: SkyPilot takes any of {', '.join(by_memory)} (its "
                           f"common/metadata.csv; Task.from_yaml_config reads {sky_gpu(gpus)} as that set)"]
        if gpus and plan.resources.gpu_memory and not plan.resources.gpu_name:
            return [asked, f"resources.gpus {gpus}: not checked against SkyPilot's catalog: its common/metadata.csv "
                           f"(each GPU's memory) is not on this machine (SkyPilot fetches it the first time it reads "
                           f"a GPU given by memory, as `sky launch` of this task does); at launch SkyPilot takes any GPU it lists with "
                           f"{sky_gpu(gpus).partition(':')[0]}"]
        if not gpus or gpus.isdigit():
            return [asked]
        accelerator = sky_gpu(gpus).partition(":")[0]
        backends = {b.lower() for b in plan.placement.backends}
        if accelerator.lower().startswith("tpu-"):
            return [asked, f"resources.gpus {accelerator}: not checked against SkyPilot's catalog: a TPU"]
        if backends & OWN_NAMES:  # their GPU names are the cluster's (a node label, a gres), not the catalog's
            return [asked, f"resources.gpus {accelerator}: not checked against SkyPilot's catalog: on "
                           f"{', '.join(sorted(backends & OWN_NAMES))} the cluster names its GPUs itself"]
        catalog = catalog_accelerators()
        if catalog is None:
            return [asked, "resources.gpus: not checked against SkyPilot's accelerator catalog: it is not on this "
                           "machine (SkyPilot fetches it on first use into ~/.sky/catalogs; any `sky` command that "
                           "reads it, e.g. `sky show-gpus`, puts it here)"]
        known = {n.lower(): n for n in catalog}
        name = plan.resources.gpu_name
        if plan.resources.gpu_memory and accelerator.lower() not in known and name and name.lower() in known:
            listed = catalog_memory().get(known[name.lower()])
            size = f" (its common/metadata.csv gives {known[name.lower()]} {listed:g}GB)" if listed else ""
            raise BadInput(f"resources.gpus: {gpus}: SkyPilot's accelerator catalog (common/accelerators.csv) has "
                           f"{known[name.lower()]} but no {accelerator}, the name it gives a GPU's memory variant "
                           f"(A100-80GB){size}: write {known[name.lower()]}:{plan.gpus_per_node}, or the memory "
                           f"alone ({sky_gpu(gpus).rpartition('-')[2]})")
        if accelerator.lower() not in known:
            raise BadInput(f"resources.gpus: {gpus}: SkyPilot's accelerator catalog (common/accelerators.csv) has "
                           f"no {accelerator!r}, so no cloud offers it "
                           f"{did_you_mean(accelerator, sorted(catalog), 'its accelerators')}")
        canonical = known[accelerator.lower()]
        clouds = catalog[canonical]
        if backends and not backends & set(clouds):
            raise BadInput(f"placement.backends: SkyPilot's accelerator catalog offers {canonical} on "
                           f"{', '.join(clouds)} only, none of {', '.join(plan.placement.backends)}")
        return [asked, f"resources.gpus {canonical} is in SkyPilot's accelerator catalog ({', '.join(clouds)})"]

    def render(self, plan: Plan) -> dict[str, str]:
        names = " ".join(f"--secret {n}" for n in plan.secrets + ([plan.token_env] if plan.token_env else []))
        header = (f"# Rendered by rlhf-tasks for SkyPilot. From this directory (the one this file is in):\n"
                  f"#   sky launch -c {plan.name} {plan.name}.sky.yaml {names}\n"
                  f"# or as a managed job: sky jobs launch {plan.name}.sky.yaml {names}\n")
        if plan.resources.shm_size and not plan.image:
            header += (f"# resources.shm_size {plan.resources.shm_size} is not applied: without an image SkyPilot runs "
                       f"on the VM, whose /dev/shm SkyPilot does not size (give the task an image to get a container "
                       f"with --shm-size)\n")
        header += ("# (sky launch resolves file_mounts and workdir against the directory it runs from)\n")
        return {f"{plan.name}.sky.yaml": dump_yaml(self.task_config(plan), header),
                **shipped_files(self.node_plan(plan))}
