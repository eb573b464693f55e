"""A Ray job whose failure happens on the last rank's node, not the driver's (tests of failure
forensics): MODE `task`, a task pinned there raises RuntimeError; `actor`, an actor's method
there raises ValueError; `actor-killed`, the actor's worker process is killed (SIGKILL, as
the kernel's OOM killer does) during a call to it. The driver, on the head, fails
with Ray's wrapper (RayTaskError, ActorDiedError) naming that node's address."""

import os
import signal
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

mode = sys.argv[1]
ray.init()


@ray.remote(num_cpus=0)
def rank():
    return int(os.environ["RLHF_TASKS_NODE_RANK"]), ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0, max_retries=0)
def work():
    raise RuntimeError("checksum mismatch in shard 7")


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class Shard:
    def step(self):
        raise ValueError("loss is nan at step 3")

    def die(self):
        os.kill(os.getpid(), signal.SIGKILL)


nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
ranks = dict(ray.get([rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                      for n in nodes]))
last = NodeAffinitySchedulingStrategy(ranks[max(ranks)], soft=False)
print("ranks", sorted(ranks), flush=True)
if mode == "task":
    ray.get(work.options(scheduling_strategy=last).remote())
shard = Shard.options(scheduling_strategy=last).remote()
if mode == "actor":
    ray.get(shard.step.remote())
ray.get(shard.die.remote())
