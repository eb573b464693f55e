"""dstack's pure half (the package's `__init__` adds `launch`, `down`, `forward` through dstack's CLI and
API): `check` (what dstack would refuse or lose money on, and, where dstack is installed here, its own
configuration models and gpuhunt's GPU table), the plan the nodes read, and the two rendered files: the
`type: task` configuration with `nodes: N` (or a task's node groups as dstack's `groups:`) and the fleet it runs on.
"""

from __future__ import annotations

import os
from pathlib import Path

from ... import workdir
from ...errors import BadInput
from ...plan import Contract, Plan, env
from ...spec import Task
from ..base import Provider, Retries
from ..shipping import LOCAL_DIR, NODE_DIR, WRITTEN_BY, agent_command, dump_yaml, shared_entry, shipped_files
from .archive import JOB_DIR, dstack_packs, upload_limit
from .offers import SPOT, dstack_gpu, dstack_resources, max_price
from .options import (SHARING, DstackPlacement, DstackShared, dstack_placement, group_dstack, per_node_name,
                      volume_backends)
from .project_secrets import SECRET_NAME_MAX, SECRET_PREFIX, secret_name, secret_reference, secret_variables

#: The fleet's `idle_duration` when the task does not set `placement.idle`: dstack's own default for a run's
#: instances (fleets.py: "Defaults to `5m` for runs and `3d` for fleets"), not the fleet's 3 days.
FLEET_IDLE_S = 300

#: The resources a task's (or a node group's) jobs ask for: the container's shared memory, the memory and CPUs
#: offers must have (a fleet asks none of them: its instances fit whatever the run asks).
RUN_RESOURCES = ("shm_size", "memory", "cpu")

#: The dstack whose `groups:` (heterogeneous multi-node tasks) this provider renders, as its errors name it.
DSTACK_GROUPS = "0.22.5"


def _field_of(error: str) -> str:
    """The task's field for the location dstack's validation error names first (`task.resources.gpu`; a node
    group's `task.groups.1.resources.gpu` is `groups[1].resources.gpus`)."""
    for line in error.splitlines()[1:]:
        loc = line.strip().split(".")
        if loc and loc[0] in ("task", "fleet"):
            loc = loc[1:]
        if not loc or " " in line.strip():
            continue
        if loc[0] == "groups" and len(loc) > 1 and loc[1].isdigit():
            inside = _field_of(f"\n{'.'.join(loc[2:])}") if loc[2:3] == ["resources"] else "the task"
            inside = inside if inside != "the task" else ".".join(loc[2:3])
            return f"groups[{loc[1]}]" + (f".{inside}" if inside else "")
        if loc[0] in ("backends", "regions"):
            return f"placement.{loc[0]}" + (f"[{loc[1]}]" if len(loc) > 1 and loc[1].isdigit() else "")
        if loc[:2] == ["resources", "gpu"]:
            return "resources.gpus"
        if loc[0] == "resources" and len(loc) > 1:
            return f"resources.{ {'cpu': 'cpus'}.get(loc[1], loc[1]) }"
        if loc[0] in ("image", "env", "user", "registry_auth", "ssh_config"):
            return {"image": "image", "env": "env"}.get(loc[0], f"placement.dstack.{loc[0]}")
        break
    return "the task"


def fleet_name(plan: Plan) -> str:
    return f"{plan.name}-fleet"


def run_image(plan: Plan) -> str | None:
    """The image every job of the run runs: the task's, or its node groups' one (DstackRender.check_group_images)."""
    return plan.groups[0].image if plan.groups else plan.image


def job_script(plan: Plan) -> str:
    """`commands` as one item: dstack runs `bash -i -c "<items joined with ' && '>"`, where a failing line inside a
    multi-line item does not stop the next (no `set -e`); one script under `set -e` stops at the first failure."""
    return "\n".join(["set -e", *plan.setup, agent_command(plan)]) + "\n"


class DstackRender(Provider):
    """The provider's pure part: options, checks, plan, render."""

    name = "dstack"
    renders_groups = True  # dstack's own `groups:`, one node group per task group (node_groups)
    shared_option = ("checkpoints.shared.dstack: {host_path: /PATH} (a directory every fleet host mounts) or {volume: "
                     "NAME} with placement.backends: [runpod]")
    sharing = SHARING
    placement_options = DstackPlacement
    contract = Contract(
        rank=env("DSTACK_NODE_RANK"),
        nodes=env("DSTACK_NODES_NUM"),
        head=env("DSTACK_MASTER_NODE_IP"),
        node_addr=env("DSTACK_NODES_IPS", item="rank"),
        cluster_id=env("DSTACK_RUN_NAME"),
        gpus_per_node=env("DSTACK_GPUS_PER_NODE"),
    )
    #: (plan_price: an SSH fleet's hosts, which dstack prices at $0, are counted at placement.price_per_hour)
    price_source = "dstack's run plan at launch (its dearest offer for each node)"
    price_bound = "dstack's max_price"
    #: What the last plan's job.working_dir packs as dstack archives it (None: nothing shipped).
    packed: workdir.Measure | None = None

    def check(self, task: Task) -> None:
        long = [variable for variable in task.secrets if len(secret_name(task.name, variable)) > SECRET_NAME_MAX]
        if long:
            raise BadInput(f"secrets.{long[0]}: its dstack project secret's name ({SECRET_PREFIX}<name>__<variable>) "
                           f"would be longer than dstack's {SECRET_NAME_MAX} characters; use a shorter variable name")
        options = dstack_placement(task.placement)
        self.check_volume(task, shared_entry(DstackShared, task.checkpoints.shared.get(self.name), self.name), options)
        image = self.check_group_images(task)
        given = [("placement.dstack", options)] + [(f"groups[{index}].placement.dstack", group_dstack(
            task.placement, group, index)) for index, group in enumerate(task.groups)]
        if not image:
            for where, own in given:
                for field in ("user", "cpu_arch", "registry_auth"):
                    if getattr(own, field) is not None:
                        raise BadInput(f"{where}.{field}: it is for a custom image, and the task gives no image "
                                       f"(dstack's default image runs as root on x86)")
        if options.ssh and task.placement.spot != "off":
            raise BadInput(f"placement.spot: {task.placement.spot}: an SSH fleet's hosts (placement.dstack.ssh) are "
                           f"no spot instances; leave placement.spot out")
        if options.ssh and (task.placement.backends or task.placement.regions):
            which = "backends" if task.placement.backends else "regions"
            raise BadInput(f"placement.{which}: the task runs on its SSH fleet (placement.dstack.ssh), which has "
                           f"no cloud {which}; leave placement.{which} out")

    @staticmethod
    def check_group_images(task: Task) -> str | None:
        """The run's image: the task's, or its groups' one image. dstack 0.22.5's NodeGroup has no `image`
        (core/models/configurations.py: name, nodes, resources, commands, ports), so every group's jobs run the
        task configuration's: a group naming another is refused."""
        if not task.groups:
            return task.image
        image = task.groups[0].image or task.image
        for index, group in enumerate(task.groups):
            if (group.image or task.image) != image:
                default = "dstack's default image"
                raise BadInput(f"groups[{index}].image: {group.image or task.image or default} is not the image of "
                               f"group {task.groups[0].name} ({image or default}): dstack {DSTACK_GROUPS} "
                               f"runs every node group's jobs in the task configuration's one image (its NodeGroup "
                               f"has no image); give the groups one image (the task's image)")
        return image

    def check_volume(self, task: Task, shared: DstackShared | None, options: DstackPlacement) -> None:
        """One network volume for every node only where the run can land on backends that mount it in several
        instances at once (SHARING): elsewhere the second node's attach fails once its instance is billed."""
        if not shared or not shared.volume:
            return
        where = "checkpoints.shared.dstack.volume"
        instead = ("checkpoints.shared.dstack: {host_path: /PATH} (a directory every fleet host mounts, e.g. an NFS "
                   "on an SSH fleet), or checkpoints.shared.sky: {bucket: ...} with --provider sky")
        if per_node_name(shared.volume):
            raise BadInput(f"{where}: {shared.volume} names one volume per node (dstack interpolates it per job), "
                           f"which no other node sees: it is not shared storage; use one volume on runpod "
                           f"(placement.backends: [runpod]) or {instead}")
        if options.ssh:
            raise BadInput(f"{where}: {shared.volume}: an SSH fleet (placement.dstack.ssh) has no dstack network "
                           f"volumes (only cloud backends implement them); use {instead}")
        if task.nodes < 2:
            return
        backends = list(task.placement.backends)
        allowed = volume_backends()
        outside = [b for b in backends if b.lower() not in allowed]
        if backends and not outside:
            return
        lands = f"placement.backends lists {', '.join(outside)}" if backends else \
            "placement.backends is empty, so the run may land on any backend"
        raise BadInput(
            f"{where}: {shared.volume}: one dstack network volume for {task.nodes} nodes is mounted by all of them "
            f"only on {' or '.join(allowed)} (a RunPod network volume; a ReadWriteMany claim), and {lands}: an "
            f"aws (EBS) or gcp volume attaches to one instance, and the second node's attach fails after its "
            f"instance is billed (the job ends VOLUME_ERROR, then dstack's retry starts over); set "
            f"placement.backends: [runpod] for a RunPod volume, or use {instead}. A volume per node "
            f"(NAME-${{{{ dstack.node_rank }}}}) is no shared storage, so not for checkpoints every node reads")

    def retries(self, plan: Plan) -> Retries | None:
        """dstack's `retry` (server/background/pipeline_tasks/runs/active.py, _should_retry_job): a job that ended
        with a termination reason whose retry event is in `on_events` is submitted again (core/models/runs.py,
        JobTerminationReason.to_retry_event: no capacity, an interruption, and every other FAILED reason is
        `error`, a non-zero exit CONTAINER_EXITED_WITH_ERROR among them); `retry.duration` (1 h by default)
        counts from the run's submission for no capacity, but from the last provisioned submission for an
        interruption or an error, so it never bounds how often a job that provisions and fails is relaunched.
        An exit 0 is DONE_BY_RUNNER, which is never retried (_job_is_done_or_finishing_done), and with
        `stop_criteria: master-done` ends the run: the head ends with it at a cap, and at the last failure
        placement.retry.errors allows, which the head counts in the spend record."""
        if not plan.placement.retry:
            return None
        errors = plan.placement.retry_errors
        return Retries(on="no capacity or an interruption" + (
            f", and after the job's own failure at most {errors} times (dstack counts none: the head does, in the "
            f"spend record, and ends the last one with exit 0, which dstack does not retry)" if errors else ""),
            unbounded="dstack's retry.duration counts from the last interruption or error, not the first",
            cites="dstack's server/background/pipeline_tasks/runs/active.py _should_retry_job",
            on_failure=bool(errors), cap_exit=0, error_retries=errors or None)

    # ------------------------------------------------------------------ job.working_dir

    def ships_working_dir(self, plan: Plan) -> bool:
        """job.working_dir travels in dstack's `files:` when the head submits the job (`submit: client`
        uploads it from here through Ray)."""
        return bool(plan.job.working_dir) and plan.job.submit == "head"

    def measure_upload(self, plan: Plan) -> Plan:
        """A shipped job.working_dir measured as `dstack apply` archives it, and refused (at check, render
        and launch) over the server's limit; `submit: client` uploads it through Ray (measured as everywhere)."""
        plan = super().measure_upload(plan)
        self.packed = dstack_packs(plan.job.working_dir) if self.ships_working_dir(plan) else None
        limit = self.over_limit(plan)
        if limit:
            raise BadInput(limit)
        return plan

    def files_path(self, plan: Plan) -> str:
        """job.working_dir as `dstack apply` resolves a `files:` path: relative to the rendered file's directory."""
        here = os.path.abspath(self.render_dir or ".")
        return os.path.relpath(os.path.abspath(os.path.expanduser(plan.job.working_dir)), here)

    def node_plan(self, plan: Plan) -> Plan:
        """The plan the nodes read: a shipped working_dir is JOB_DIR, where dstack unpacks it."""
        if not self.ships_working_dir(plan):
            return plan
        return plan.replace(job=plan.job.model_copy(update={"working_dir": JOB_DIR}))

    def working_dir_words(self, plan: Plan) -> str | None:
        if not self.ships_working_dir(plan):
            return None
        packed = self.packed
        size = f" ({workdir.human(packed.size)} as dstack packs it, its limit {workdir.human(upload_limit())})" \
            if packed else ""
        return (f"{plan.job.working_dir}{size}: `dstack apply` ships it (dstack's files:, leaving out what .gitignore "
                f"and .dstackignore name) to {JOB_DIR} on every node, where the job's commands run (dstack's "
                f"working_dir), and the head submits the job from there (leaving out job.excludes)")

    def over_limit(self, plan: Plan) -> str | None:
        """Why dstack's server would refuse the shipped working_dir, with what to leave out; None when it fits."""
        packed, limit = self.packed, upload_limit()
        if not self.ships_working_dir(plan) or packed is None or not limit or packed.size <= limit:
            return None
        top = [(name + ("/" if (Path(plan.job.working_dir) / name).is_dir() else ""), size)
               for name, size in packed.biggest[:5] if size * 100 >= packed.size]
        listed = ", ".join(f"{name} {workdir.human(size)}" for name, size in top)
        lines = ", ".join(f"/{name}" for name, _ in workdir.enough(top, packed.size - limit + 1))
        return (f"job.working_dir: {plan.job.working_dir} packs {workdir.human(packed.size)} as `dstack apply` archives "
                f"it (measured with {packed.how}), over the dstack server's limit of {workdir.human(limit)} "
                f"(DSTACK_SERVER_CODE_UPLOAD_LIMIT, set on the server: where yours is higher, set it here too); the "
                f"biggest entries: {listed}. dstack's files: "
                f"reads .gitignore and .dstackignore there, not job.excludes: list what the job does not need in "
                f"{Path(plan.job.working_dir) / '.dstackignore'} (one a line, e.g. {lines}), or set job.working_dir to the "
                f"directory of the job's code only (null: none)")

    # ------------------------------------------------------------------ what check and render say

    def shared_storage_warning(self, plan: Plan) -> str | None:
        """A line for `check` and `render` when a multi-node run resumes from per-host directories."""
        if plan.nodes < 2 or not plan.unshared_checkpoints:
            return None
        return (f"checkpoints {plan.checkpoint_dir} is a directory on each dstack host (instance_path): "
                f"the {plan.nodes} nodes do not share it, and a resumed run may land on other hosts; add "
                f"{self.shared_option}")

    def notes(self, plan: Plan) -> list[str]:
        out = super().notes(plan)
        options = dstack_placement(plan.placement)
        if run_image(plan) and (options.user is None or options.cpu_arch is None):
            missing = " and ".join(f for f in ("user", "cpu_arch") if getattr(options, f) is None)
            out.append(f"image {run_image(plan)}: without placement.dstack.{missing}, dstack's server reads the "
                       f"image's configuration from its registry when the run is submitted (a private registry needs "
                       f"placement.dstack.registry_auth; an image the registry cannot serve fails the run)")
        if plan.groups and max_price(plan) and plan.placement.price_per_hour is not None:
            out.append(f"placement.price_per_hour: dstack's max_price is one bound on every instance of the run, each "
                       f"node group's alike (offers.max_price): ${max_price(plan):.4g}/h, the cluster's "
                       f"${plan.placement.price_per_hour:.4g}/h over its {plan.nodes} nodes, so a group whose nodes "
                       f"cost more finds no offer even where the whole would fit the price; give each group's "
                       f"price_per_hour instead (the bound is then the dearest group's node)")
        elif plan.groups and max_price(plan):
            out.append(f"groups[i].price_per_hour: dstack's max_price is one bound on every instance of the run "
                       f"(offers.max_price): ${max_price(plan):.4g}/h, the dearest group's node, holds the cheaper "
                       f"groups' nodes too; the head counts the groups' sum, or dstack's run plan at launch")
        if plan.budget.max_cost is not None and plan.budget.price_per_hour is None:
            out.append("placement.max_cost: a `dstack apply` of the rendered file by hand counts no price, so its head "
                       "never stops the job at the cap (placement.max_duration still holds); `rlhf-tasks launch` counts "
                       "dstack's run plan's price (and refuses a plan that prices the offers at $0, an SSH fleet's); "
                       "give placement.price_per_hour for a hand apply")
        shared = shared_entry(DstackShared, plan.checkpoint_shared, self.name)
        if shared and shared.volume and plan.nodes > 1:
            for rule in SHARING:
                if rule.form == "volume" and rule.shared.startswith("if ") and \
                        rule.backend in [b.lower() for b in plan.placement.backends]:
                    out.append(f"checkpoints.shared.dstack.volume {shared.volume} on {rule.backend}: every node mounts "
                               f"it only {rule.shared} ({rule.why}): `check` cannot see it")
        return out

    # ------------------------------------------------------------------ dstack's own code

    def ask_own_code(self, plan: Plan) -> list[str]:
        """The render as dstack's own code takes it, where dstack is installed here (offline): its backend
        names (BackendType), its configuration models (parse_apply_configuration, what `dstack apply`
        parses), and the GPU names its offers can match: dstack compares an offer's GPU name with the
        spec's, ignoring case (core/backends/base/offers.py, gpu_matches_gpu_spec), and the names offers
        carry are gpuhunt's (gpuhunt's KNOWN_ACCELERATORS, with the memory sizes each comes in), so a name
        outside that table matches no offer."""
        try:
            import gpuhunt
            from dstack._internal.core.errors import ConfigurationError
            from dstack._internal.core.models.backends.base import BackendType
            from dstack._internal.core.models.configurations import parse_apply_configuration
            from dstack.version import __version__ as version
        except ImportError:
            return ["dstack's configuration models, backend names and GPU table (gpuhunt): not checked: dstack is "
                    "not installed here (pip install 'rlhf-tasks[dstack]')"]
        import yaml

        from ...models import did_you_mean

        parsed = {}
        for name, text in self.render(plan).items():
            if name.endswith(".dstack.yml"):
                try:
                    parsed[name] = parse_apply_configuration(yaml.safe_load(text))
                except ConfigurationError as exc:
                    field = _field_of(str(exc))
                    hint = ""
                    if field.startswith("placement.backends["):  # the backend names are BackendType's
                        wrong = plan.placement.backends[int(field.split("[")[1].rstrip("]"))]
                        hint = "\n  " + did_you_mean(wrong, [b.value for b in BackendType], "its backends")
                    raise BadInput(f"{field}: dstack {version} refuses {name}: "
                                   + str(exc).strip().replace("\n", "\n  ") + hint) from None
        configuration = next(iter(parsed.values()))
        table: dict[str, set[int]] = {}
        for accelerator in gpuhunt.KNOWN_ACCELERATORS:
            table.setdefault(accelerator.name, set()).add(int(accelerator.memory))
        asked = [("resources.gpus", plan.resources.gpus, configuration.resources.gpu)] if not plan.groups else [
            (f"groups[{index}].resources.gpus", group.machine.gpus, configuration.groups[index].resources.gpu)
            for index, group in enumerate(plan.groups)]
        notes: list[str] = []
        for field, gpu, spec in asked:
            if gpu and not gpu.isdigit():
                notes += gpu_names_offered(field, gpu, spec, table, version)
        return [f"dstack {version}'s configuration models (parse_apply_configuration) take "
                f"{' and '.join(parsed)}; backends and GPU names are dstack's and gpuhunt's", *notes]

    # ------------------------------------------------------------------ the rendered files

    def task_config(self, plan: Plan, files: dict[str, str]) -> dict:
        res, placement = plan.resources, plan.placement
        options = dstack_placement(placement)
        config: dict = {"type": "task", "name": plan.name}
        if not plan.groups:
            config["nodes"] = plan.nodes
        if run_image(plan):
            config["image"] = run_image(plan)
            config["shell"] = "bash"
            if options.user:
                config["user"] = options.user
            if options.registry_auth:
                config["registry_auth"] = {"username": options.registry_auth.username,
                                           "password": f"${{{{ secrets.{options.registry_auth.password_secret} }}}}"}
        env = [f"{k}={v}" for k, v in plan.env.items()]
        env += [f"{name}={secret_reference(plan.name, name)}" for name in secret_variables(plan)]
        if env:
            config["env"] = env
        config["files"] = [f"{LOCAL_DIR}:{NODE_DIR}"]  # one archive of the directory rendered beside
        if self.ships_working_dir(plan):
            config["files"].append(f"{self.files_path(plan)}:{JOB_DIR}")
            config["working_dir"] = JOB_DIR
        if plan.groups:
            config["groups"] = self.node_groups(plan)
        else:
            config["commands"] = [job_script(plan)]
            config["ports"] = [plan.ray.dashboard_port]
            config["resources"] = dstack_resources(res, RUN_RESOURCES, options.cpu_arch)
        ckpt = plan.checkpoint_dir
        if ckpt:
            shared = shared_entry(DstackShared, plan.checkpoint_shared, self.name)
            if shared and shared.volume:
                config["volumes"] = [{"name": shared.volume, "path": ckpt}]
            else:
                config["volumes"] = [{"instance_path": shared.host_path if shared else ckpt, "path": ckpt}]
        config["startup_order"] = "master-first"
        config["stop_criteria"] = "master-done"
        config["spot_policy"] = SPOT[placement.spot]
        if max_price(plan):
            config["max_price"] = max_price(plan)
        if placement.retry:  # the job's own failure only when asked: a bad flag fails every attempt alike
            config["retry"] = {"on_events": ["no-capacity", "interruption"] + (["error"] if placement.retry_errors
                                                                               else [])}
        if placement.max_duration:
            config["max_duration"] = int(placement.max_duration)  # seconds
        if placement.fleets or options.ssh:  # an SSH fleet's hosts are the task's own
            config["fleets"] = list(placement.fleets) or [fleet_name(plan)]
        for key in ("backends", "regions"):
            if getattr(placement, key):
                config[key] = list(getattr(placement, key))
        return config

    def node_groups(self, plan: Plan) -> list[dict]:
        """The task's node groups as dstack 0.22.5's `groups:` (core/models/configurations.py NodeGroup: `name`,
        `nodes`, `resources`, `commands`, `ports`), in the task's order: dstack numbers the jobs across the groups
        in that order (server/services/jobs/configurators/task.py get_job_specs: job_num counts on from group to
        group), and DSTACK_NODE_RANK is the job number, so a group's ranks start at its first_rank, as the plan
        counts them, and the master (DSTACK_MASTER_NODE_IP, the cluster's job_ips[0]: background/pipeline_tasks/
        jobs_running.py _get_cluster_info) is the first group's first node, the head. The dashboard's port is the
        first group's only: `dstack apply` attaches to job 0 and forwards its ports alone (api/_public/runs.py
        Run.attach)."""
        groups = []
        for index, group in enumerate(plan.groups):
            options = group_dstack(plan.placement, group, index)
            entry = {"name": group.name, "nodes": group.nodes,
                     "resources": dstack_resources(group.machine, RUN_RESOURCES, options.cpu_arch),
                     "commands": [job_script(plan.for_group(group))]}
            if index == 0:
                entry["ports"] = [plan.ray.dashboard_port]
            groups.append(entry)
        return groups

    def fleet_config(self, plan: Plan) -> dict:
        """A fleet with `placement: cluster` (nodes on one fast network) that fits the task.

        On cloud backends, `nodes: {min: 0, max: N}`: the fleet starts empty, the run provisions its N instances
        in it, and an instance idle for `idle_duration` (placement.idle where the task sets it, `never` rendering
        `off`; else FLEET_IDLE_S) is terminated, since dstack terminates only instances above `nodes.min`
        (fleets.py, idle_duration): nothing is left billing. With node groups, `max` counts every group's nodes and
        the fleet gives no `resources`: a fleet's resources are combined with each job's to filter its offers
        (server/services/requirements/combine.py combine_fleet_and_run_requirements), and a fleet without them
        is unconstrained (server/services/fleets.py get_fleet_requirements): each group's own resources choose.
        With placement.dstack.ssh, the user's hosts in `ssh_config`, and none of the cloud fleet's fields, which
        dstack refuses for an SSH fleet.
        """
        placement = plan.placement
        ssh = dstack_placement(placement).ssh
        fleet: dict = {"type": "fleet", "name": fleet_name(plan)}
        if ssh:
            fleet["placement"] = "cluster"
            fleet["ssh_config"] = {key: value for key, value in ssh.model_dump().items() if value is not None}
            return fleet
        idle = placement.idle if "idle" in placement.model_fields_set else FLEET_IDLE_S
        fleet.update({"nodes": {"min": 0, "max": plan.nodes}, "idle_duration": int(idle) if idle else "off",
                      "placement": "cluster"})
        if not plan.groups:  # a fleet's resources bound every instance's offers: with groups, each group's own
            fleet["resources"] = dstack_resources(plan.resources, ())
        fleet["spot_policy"] = SPOT[plan.placement.spot]
        if max_price(plan):  # a cloud fleet's field (dstack refuses it for an SSH fleet); the lower of the two counts
            fleet["max_price"] = max_price(plan)
        for key in ("backends", "regions"):
            if getattr(plan.placement, key):
                fleet[key] = list(getattr(plan.placement, key))
        return fleet

    def render(self, plan: Plan) -> dict[str, str]:
        files = shipped_files(self.node_plan(plan))
        header = f"# Rendered by rlhf-tasks for dstack; apply with: dstack apply -f <this file>\n"
        if secret_variables(plan):
            header += ("# Secrets: dstack project secrets, put into the job's env by dstack's server (`rlhf-tasks\n"
                       "# launch` sets them, `rlhf-tasks down` deletes them). To apply this file by hand, set each\n"
                       "# first (dstack's CLI takes the value as an argument) and delete each after the run\n"
                       "# (dstack secret delete NAME -y):\n")
            for name in secret_variables(plan):
                value = f"$(rlhf-tasks token {plan.name})" if name == plan.token_env else f"${name}"
                header += f"#   dstack secret set {secret_name(plan.name, name)} \"{value}\"\n"
        if self.ships_working_dir(plan):
            header += (f"# (dstack apply resolves files: against the directory this file is in: job.working_dir "
                       f"{plan.job.working_dir} is {self.files_path(plan)} from there)\n")
        out = {f"{plan.name}.dstack.yml": dump_yaml(self.task_config(plan, files), header),
               f"{fleet_name(plan)}.dstack.yml": dump_yaml(
                   self.fleet_config(plan), f"# {WRITTEN_BY} for dstack: the fleet {plan.name} runs on. "
                   "Apply once before the task: dstack apply -f <this file>\n")}
        out.update(files)
        return out


def gpu_names_offered(field: str, gpu: str, spec, table: dict[str, set[int]], version: str) -> list[str]:
    """A task's (or a node group's) GPUs as dstack's parsed GPU spec (`spec`) against gpuhunt's GPU table (`table`:
    name -> the memory sizes it comes in): BadInput naming `field` where no dstack offer can carry them; the
    note `check` prints for GPUs asked by memory alone."""
    from ...models import did_you_mean

    lower = {name.lower(): name for name in table}
    memory = spec.memory
    notes = []
    if not spec.name and memory is not None:  # by memory alone: the GPUs gpuhunt has of that memory
        fits = sorted(n for n, sizes in table.items() if any(
            (memory.min is None or memory.min <= size) and (memory.max is None or size <= memory.max)
            for size in sizes))
        if not fits:
            raise BadInput(f"{field}: {gpu}: gpuhunt's GPU table has no GPU of {memory}, so no "
                           f"dstack offer matches {dstack_gpu(gpu)} (its GPUs' memory: "
                           f"{', '.join(f'{size}GB' for size in sorted({s for v in table.values() for s in v} - {0}))})")
        notes.append(f"{field} {gpu}: dstack takes any GPU of gpuhunt's table with that memory: {', '.join(fits)}")
    for name in spec.name or []:
        if name.lower() not in lower:
            raise BadInput(f"{field}: {gpu}: dstack {version} renders GPU name {name!r}, which no "
                           f"dstack offer carries: gpuhunt's GPU table has no such GPU "
                           f"{did_you_mean(name, sorted(table), 'its GPUs')}")
        sizes = table[lower[name.lower()]]
        if memory is not None and memory.min is not None and not any(
                memory.min <= size <= (memory.max if memory.max is not None else size) for size in sizes):
            raise BadInput(f"{field}: {gpu}: gpuhunt's GPU table has {lower[name.lower()]} with "
                           f"{', '.join(f'{size}GB' for size in sorted(sizes))} only, so no dstack offer "
                           f"matches {dstack_gpu(gpu)}")
    return notes
