"""The task's image on Slurm: pyxis (`srun --container-image`, in the Slurm step) or docker/podman run on
every node, whose container lives outside the step: the per-node wrapper (`container.sh`) that stops and
removes it by name however the task ends, and the words of the container's command.
"""

from __future__ import annotations

import shlex

from ...plan import Plan, gpu_vendor
from ..base import AMD_CONTAINER_OPTIONS, docker_size
from .placement import slurm_placement

#: Inside a container there is no scontrol: the script expands the host list once, into this variable.
HOSTS_ENV = "RLHF_TASKS_HOSTS"
#: The Slurm variables a container needs to be given by name (docker/podman start clean).
CONTRACT_VARS = ("SLURM_NODEID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_ID", HOSTS_ENV)
#: The GPUs Slurm gave the job, by vendor: passed on, since the container sees every device.
GPU_SELECTION_VAR = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}
#: The container engines whose containers live outside the Slurm step (pyxis runs in it).
ENGINES = ("docker", "podman")
#: Every node's container is called this (one per node: each node has its own engine).
CONTAINER_NAME = "{name}-{job_id}"
#: Seconds a stopped container's agent gets (it stops Ray and the services) before the engine kills it.
CONTAINER_STOP_S = 20
CONTAINER_EOF = "RLHF_TASKS_CONTAINER_SH"
#: The per-node wrapper around `docker run`/`podman run`: the container goes when the task goes.
CONTAINER_SH = f"""\
#!/bin/bash
# rlhf-tasks: one node's container, stopped and removed by its name however this task ends.
# The engine runs the container outside the Slurm step, so Slurm's signals (and its SIGKILL,
# KillWait seconds after scancel or the time limit) reach only the engine's client.
#   container.sh NAME ENGINE run ...   runs `ENGINE run ... --name=NAME ...`, then removes NAME
#   container.sh NAME ENGINE stop      stops and removes NAME (the script's clean-up step)
name=$1 engine=$2
shift
stop() {{
    "$engine" stop --time={CONTAINER_STOP_S} "$name" >/dev/null 2>&1
}}
remove() {{
    stop
    "$engine" rm --force "$name" >/dev/null 2>&1
}}
if [ "$2" = stop ]; then
    remove
    if "$engine" container inspect "$name" >/dev/null 2>&1; then
        echo "rlhf-tasks: container $name is still there on $(hostname)" >&2
        exit 1
    fi
    exit 0
fi
trap 'trap "" TERM INT HUP; echo "rlhf-tasks: signalled: stopping container $name" >&2; stop' TERM INT HUP
"$@" &
client=$!
while :; do  # a signal ends a wait early: wait again, for the client to pass on the agent's last lines
    wait "$client"
    status=$?
    kill -0 "$client" 2>/dev/null || break
done
remove
exit "$status"
"""


def container_lines(plan: Plan) -> list[list[str]]:
    """Shell words (quoted), a line of them per option, that run the agent in the image."""
    slurm, q = slurm_placement(plan.placement), shlex.quote
    workdir = '"$job_dir"' if plan.job.working_dir else '"$run_dir"'
    mounts = (['"$job_dir":"$job_dir"'] if plan.job.working_dir else []) + ['"$run_dir":"$run_dir"'] + (
        [q(f"{plan.checkpoint_dir}:{plan.checkpoint_dir}")] if plan.checkpoint_dir else []) + [
        q(m) for m in slurm.mounts]
    if slurm.container == "pyxis":
        return [[f"--container-image={q(plan.image)}"], ["--container-mounts=" + ",".join(mounts)],
                [f"--container-workdir={workdir}"]]
    engine = slurm.container
    lines = [["bash", '"$run_dir/container.sh"', '"$container"'],  # stops the container when the task ends
             [engine, "run", "--rm", "--init", '--name="$container"'], ["--network=host"]]
    # The task's /dev/shm in a namespace of the container's own, as verl's AMD script sizes it; else the host's.
    # Not both: podman refuses --shm-size with --ipc=host (libpod: "cannot set shmsize when running in the
    # host IPC Namespace"), and docker ignores the size there.
    if plan.resources.shm_size:
        lines[-1].append(f"--shm-size={docker_size(plan.resources.shm_size)}")
    else:
        lines[-1].append("--ipc=host")
    vendor = gpu_vendor(plan.resources.gpu_name) if plan.gpus_per_node else None
    if vendor == "amd":  # as verl's AMD script and ROCm's container guide run them
        lines += [list(AMD_CONTAINER_OPTIONS[:3]), list(AMD_CONTAINER_OPTIONS[3:])]
    elif vendor == "nvidia":
        lines.append(["--gpus=all" if engine == "docker" else "--device=nvidia.com/gpu=all"])
    if plan.network == "infiniband":
        lines.append(["--device=/dev/infiniband", "--ulimit=memlock=-1:-1"])
    if slurm.privileged:
        lines.append(["--privileged"])
    names = [*CONTRACT_VARS, *([GPU_SELECTION_VAR[vendor]] if vendor else []), *plan.secrets,
             *([plan.token_env] if plan.token_env else []), *plan.env]
    lines += [[f"--env={name}"] for name in dict.fromkeys(names)]
    # No PYTHONPATH of ours: the image's own stays, the agent runs by its path and puts lib/ before
    # the image's entries for everything it starts (raynode.node_env).
    lines += [[f"--volume={mount}"] for mount in mounts]
    lines += [[f"--workdir={workdir}"], [q(plan.image)]]
    return lines
